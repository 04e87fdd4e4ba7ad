"""Starting jobs with one script each leaves Redis as RQ's own objects do (a real Valkey):
the same keys, fields, registries, expiries and counters; a job that stopped waiting is
not started."""

from __future__ import annotations

import redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from mlxq.broker import batches, keys
from mlxq.broker.intake import dequeue_many, register
from mlxq.broker.rq_store import rq_keys, start_script
from mlxq.broker.rq_store.counters import batch_of, move
from mlxq.broker.serializer import serializer
from mlxq.wire import Request
from mlxq.worker.rq_worker import MlxqWorker
from tests.helpers import dequeued


def _start_through_rq(worker: MlxqWorker, job: Job, queue) -> Execution:
    """What RQ's objects write to start a job (the path the script replaces)."""
    with worker.connection.pipeline() as pipe:
        ttl = worker.get_heartbeat_ttl(job)
        execution = Execution.create(job, ttl, pipeline=pipe, worker_name=worker.name)
        move(pipe, job.id, batch_of(job), "started")
        job.prepare_for_execution(worker.name, pipeline=pipe)
        pipe.persist(job.key)
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
        pipe.delete(keys.stranded(job.id))
        pipe.execute()
    return execution


def _state(conn: redis.Redis, job: Job, queue, execution: Execution) -> dict:
    """What Redis holds about one started job, with its ids and times taken out."""
    hash_ = conn.hgetall(job.key)
    started = StartedJobRegistry("starts", connection=conn).key
    exec_key = rq_keys.execution_key(job.id, execution.id)
    score = conn.zscore(started, execution.composite_key)
    return {
        "hash fields": sorted(hash_),
        "status": hash_[b"status"],
        "mlxq_state": hash_[b"mlxq_state"],
        "worker": hash_[b"worker_name"],
        "started_at is last_heartbeat": hash_[b"started_at"] == hash_[b"last_heartbeat"],
        "job ttl": conn.ttl(job.key),
        "execution fields": sorted(conn.hgetall(exec_key)),
        "execution expires": conn.ttl(exec_key) > 0,
        "executions": conn.zcard(rq_keys.executions_key(job.id)),
        "executions expire": conn.ttl(rq_keys.executions_key(job.id)) > 0,
        "started score": round(score - conn.time()[0]) if score is not None else None,
        "in worker's executions": conn.sismember(
            execution.worker_executions_key, execution.composite_key
        ),
        "still intermediate": conn.lpos(queue.intermediate_queue_key, job.id),
    }


def test_a_job_starts_as_rq_starts_it(conn: redis.Redis) -> None:
    batch, worker, ((a, qa), (b, qb)) = dequeued(conn, 2, "starts")
    for job in (a, b):  # (a job with an expiry, as RQ's enqueue ttl gives: started, it keeps)
        conn.expire(job.key, 1000)
    ea = _start_through_rq(worker, a, qa)
    (eb,) = start_script.start_jobs(worker, [(b, qb)])
    assert eb is not None and eb.id in worker.executions
    ours, rqs = _state(conn, b, qb, eb), _state(conn, a, qa, ea)
    assert ours == rqs
    assert ours["status"] == b"started" and ours["job ttl"] == -1
    assert abs(ours["started score"] - worker.get_heartbeat_ttl(b)) <= 1
    # the Python job as RQ leaves it, and RQ reads it back
    assert b.get_status(refresh=False) == JobStatus.STARTED and b.worker_name == worker.name
    assert b.started_at is not None and b.started_at == b.last_heartbeat
    fetched = Job.fetch(b.id, connection=conn, serializer=serializer)
    assert fetched.get_status() == JobStatus.STARTED
    assert fetched.worker_name == worker.name
    registry = StartedJobRegistry("starts", connection=conn)
    assert set(registry.get_job_ids()) == {a.id, b.id}
    assert conn.hget(worker.key, "state") == b"busy"
    status = batches.batch_status(conn, batch)
    assert (status.queued, status.started) == (0, 2), status


def test_a_job_that_stopped_waiting_is_not_started(conn: redis.Redis) -> None:
    """Cancelled, taken back by a sweeper, or out of every list: not started, while the rest
    of the group starts; the job out of every list is put back on its queue, not dropped."""
    batch, worker, group = dequeued(conn, 4, "starts")
    (cancelled, _), (swept, queue), (lost, _), _ = group
    conn.hset(cancelled.key, "status", "canceled")
    conn.lrem(queue.intermediate_queue_key, 1, swept.id)  # the sweep's move
    conn.rpush(queue.key, swept.id)
    conn.lrem(queue.intermediate_queue_key, 1, lost.id)  # as RQ's BLPOP path left it
    before = [conn.hgetall(job.key) for job in (cancelled, swept, lost)]
    executions = register(worker, group)
    assert executions[:3] == [start_script.REFUSED[c] for c in (-2, 0, -1)]
    assert not isinstance(executions[3], str)
    assert [conn.hgetall(job.key) for job in (cancelled, swept, lost)] == before
    for job in (cancelled, swept, lost):
        assert not conn.exists(rq_keys.executions_key(job.id))
    assert list(worker.executions) == [executions[3].id]
    # the cancelled id is gone from every list; the other two wait on the queue, once each
    assert conn.lrange(queue.intermediate_queue_key, 0, -1) == []
    assert sorted(conn.lrange(queue.key, 0, -1)) == sorted([swept.id.encode(), lost.id.encode()])
    status = batches.batch_status(conn, batch)
    assert (status.started, status.queued) == (1, 3), status


def test_no_job_of_a_cancelled_batch_starts_however_it_was_taken(conn: redis.Redis) -> None:
    """Taken before its batch's cancel, started after it: the script refuses it (its batch's
    flag, one key), and the refusal ends it cancelled, out of every list, counted once. A
    job of another batch in the same group starts."""
    batch, worker, group = dequeued(conn, 3, "starts")
    other = batches.submit(conn, [Request(prompt="o", max_tokens=2)], queue="starts").batch_id
    group += dequeue_many(worker, 1)  # the other batch's job
    assert batch_of(group[3][0]) == other
    (taken, queue), (swept, _), (lost, _), _ = group
    conn.lrem(queue.intermediate_queue_key, 1, swept.id)  # a sweep put it back on its queue
    conn.rpush(queue.key, swept.id)
    conn.lrem(queue.intermediate_queue_key, 1, lost.id)  # out of every list, still queued
    batches.mark_cancelled(conn, batch)  # the cancel's first step only: its jobs still "queued"
    executions = register(worker, group)
    assert executions[:3] == [start_script.REFUSED[-3]] * 3
    assert not isinstance(executions[3], str)
    for job in (taken, swept, lost):
        assert Job.fetch(job.id, connection=conn).get_status() == JobStatus.CANCELED
        assert conn.xlen(rq_keys.results_key(job.id)) == 1
        assert not conn.exists(rq_keys.executions_key(job.id))
    assert conn.lrange(queue.intermediate_queue_key, 0, -1) == []
    assert conn.lrange(queue.key, 0, -1) == []
    status = batches.batch_status(conn, batch)
    assert (status.cancelled, status.queued, status.started) == (3, 0, 0), status
    results = list(batches.iter_batch_results(conn, batch))
    assert {r.finish_reason for r in results} == {"cancelled"}
    assert batches.batch_status(conn, other).started == 1
    # its cancel's second step finds nothing left, and starts nothing either
    assert batches.cancel_batch(conn, batch) == (0, 0)
