"""Jobs stranded between dequeue and registration, and results owed while Redis is away:
put back or written later, never lost and never run twice (a real Valkey)."""

from __future__ import annotations

import time

import msgspec
import redis
from rq.job import Job, JobStatus
from rq.worker import Worker

from mlxq.broker import batches, keys
from mlxq.broker.intake import dequeue_many, register
from mlxq.broker.recovery import requeue_stranded
from mlxq.broker.rq_store import rq_keys, start_script
from mlxq.broker.serializer import serializer
from mlxq.wire import JobMeta, Request, Result
from mlxq.worker.outcomes import InFlight
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.writeback import Writeback
from tests.helpers import waiting


def _setup(conn: redis.Redis, n: int) -> tuple[str, Worker]:
    reqs = [Request(prompt=f"p{i}", max_tokens=4, custom_id=f"c{i}") for i in range(n)]
    batch = batches.submit(conn, reqs, queue="strand").batch_id
    worker = Worker([batches.make_queue(conn, "strand")], connection=conn, serializer=serializer)
    return batch, worker


def _ids(conn: redis.Redis, key: str) -> list[str]:
    return [x.decode() for x in conn.lrange(key, 0, -1)]


def test_a_job_stranded_in_the_intermediate_queue_goes_back_after_the_grace(conn):
    batch, worker = _setup(conn, 3)
    queue = worker.queues[0]
    ((job, _),) = dequeue_many(worker, 1)  # dequeued, and then the worker died
    assert _ids(conn, queue.intermediate_queue_key) == [job.id]
    assert requeue_stranded(queue, grace_s=3600) == []  # first sighting: marked only
    assert requeue_stranded(queue, grace_s=3600) == []  # not stranded long enough
    assert conn.exists(keys.stranded(job.id))
    assert requeue_stranded(queue, grace_s=0) == [job.id]
    assert _ids(conn, queue.intermediate_queue_key) == []
    # back on RQ's list, taken before any lane: at the front, where it was
    assert _ids(conn, queue.key) == [job.id] and waiting(conn, "strand") == 3
    assert not conn.exists(keys.stranded(job.id))
    status = batches.batch_status(conn, batch)
    assert (status.queued, status.started) == (3, 0), status


def test_a_deleted_job_leaves_the_intermediate_queue_without_coming_back(conn):
    _, worker = _setup(conn, 1)
    queue = worker.queues[0]
    ((job, _),) = dequeue_many(worker, 1)
    conn.delete(job.key)
    requeue_stranded(queue, grace_s=3600)
    assert requeue_stranded(queue, grace_s=3600) == []
    assert _ids(conn, queue.intermediate_queue_key) == []
    assert _ids(conn, queue.key) == []


def _stranded_long_ago(conn: redis.Redis) -> tuple[Worker, Job]:
    """A job stranded in the intermediate queue, marked by RQ's cleanup an hour ago."""
    _, rq_worker = _setup(conn, 1)
    queue = rq_worker.queues[0]
    ((job, _),) = dequeue_many(rq_worker, 1)
    conn.set(rq_keys.intermediate_first_seen_key(queue, job.id), time.time() - 3600)
    return rq_worker, job


def test_rqs_own_maintenance_fails_a_stranded_job(conn):
    """Why mlxq's worker leaves that cleanup out (this fails if RQ changes it)."""
    rq_worker, job = _stranded_long_ago(conn)
    rq_worker.clean_registries()
    assert Job.fetch(job.id, connection=conn).get_status() == JobStatus.FAILED


def test_an_mlxq_worker_leaves_stranded_jobs_to_its_sweep(conn):
    rq_worker, job = _stranded_long_ago(conn)
    queue = rq_worker.queues[0]
    worker = MlxqWorker([queue], connection=conn, runner=None, model_name="m")  # type: ignore[arg-type]
    worker.clean_registries()
    assert Job.fetch(job.id, connection=conn).get_status() == JobStatus.QUEUED
    requeue_stranded(queue, grace_s=0)
    assert requeue_stranded(queue, grace_s=0) == [job.id]
    assert not conn.exists(rq_keys.intermediate_first_seen_key(queue, job.id))


def test_registering_a_job_the_sweep_took_back_gives_it_up(conn):
    """A worker that stalls between dequeue and registration (a laptop lid closed) finds
    its job put back; it must not run it too."""
    batch, worker = _setup(conn, 2)
    queue = worker.queues[0]
    group = dequeue_many(worker, 2)
    requeue_stranded(queue, grace_s=0)  # marks both
    taken, kept = group
    # The sweep takes one back; the other was dequeued moments ago, still in grace.
    conn.set(keys.stranded(kept[0].id), 2**40)
    assert requeue_stranded(queue, grace_s=0) == [taken[0].id]
    executions = register(worker, group)
    assert isinstance(executions[0], str) and not isinstance(executions[1], str)
    assert Job.fetch(taken[0].id, connection=conn).get_status() == JobStatus.QUEUED
    assert Job.fetch(kept[0].id, connection=conn).get_status() == JobStatus.STARTED
    assert _ids(conn, queue.key) == [taken[0].id]
    assert not conn.exists(keys.stranded(kept[0].id))  # registered: the mark is cleared
    status = batches.batch_status(conn, batch)
    assert (status.queued, status.started) == (1, 1), status


def test_results_owed_while_redis_is_away_are_written_when_it_is_back(conn, valkey_url):
    batch, worker = _setup(conn, 1)
    group = dequeue_many(worker, 1)
    (execution,) = register(worker, group)
    job, queue = group[0]
    inf = InFlight(
        job, queue, execution, Request(prompt="p0"), msgspec.convert(job.meta, JobMeta), 0.0
    )
    result = Result(job_id=job.id, custom_id="c0", finish_reason="stop", text="done")
    owed = Writeback()
    owed.done.append((inf, result))
    worker.connection = redis.Redis(port=1, socket_connect_timeout=0.5)  # Redis is gone
    try:
        owed.flush(worker)
    except redis.ConnectionError:
        pass
    else:
        raise AssertionError("a write to a dead Redis succeeded")
    assert len(owed) == 1  # kept for the next try
    worker.connection = conn
    owed.flush(worker)
    assert len(owed) == 0
    assert [r.text for r in batches.iter_batch_results(conn, batch)] == ["done"]
    status = batches.batch_status(conn, batch)
    assert (status.finished, status.started) == (1, 0), status


def test_a_job_cancelled_between_dequeue_and_registration_never_runs(conn):
    batch, worker = _setup(conn, 2)
    queue = worker.queues[0]
    group = dequeue_many(worker, 2)
    cancelled = group[0][0]
    batches.cancel_jobs(conn, [cancelled.id])  # `mlxq cancel JOB`: to RQ it still waits
    executions = register(worker, group)
    assert executions[0] == start_script.REFUSED[-2] and not isinstance(executions[1], str)
    assert Job.fetch(cancelled.id, connection=conn).get_status() == JobStatus.CANCELED
    assert requeue_stranded(queue, grace_s=3600) == []  # its id is dropped, not requeued
    assert _ids(conn, queue.intermediate_queue_key) == []
    assert _ids(conn, queue.key) == []
    status = batches.batch_status(conn, batch)
    assert (status.cancelled, status.started, status.queued) == (1, 1, 0), status
