"""Ending finished jobs with one script each leaves Redis as RQ's own objects do (a real
Valkey): the same keys, fields, registries, expiries and counters, read back by RQ."""

from __future__ import annotations

import base64

import msgspec
import pytest
import redis
from rq.job import Job, JobStatus
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.results import Result as RQResult

from mlxq.broker import batches, keys
from mlxq.broker.intake import register
from mlxq.broker.rq_store import end_script, rq_keys, transitions
from mlxq.broker.serializer import serializer
from mlxq.wire import Result
from tests.helpers import dequeued


def _started(conn: redis.Redis, n: int, result_ttl: int = keys.DEFAULT_RESULT_TTL):
    batch, worker, group = dequeued(conn, n, "ends", result_ttl)
    executions = register(worker, group)
    return batch, worker, [(j, qu, e) for (j, qu), e in zip(group, executions, strict=True)]


def _result(job: Job) -> Result:
    return Result(
        job_id=job.id, custom_id="c", finish_reason="stop", text="ok", token_ids=[1], worker="w1"
    )


def _state(conn: redis.Redis, job: Job, execution, worker) -> dict:
    """What Redis holds about one ended job, with its ids and times taken out."""
    entries = conn.xrange(rq_keys.results_key(job.id))
    (_, fields), *more = entries
    hash_ = conn.hgetall(job.key)
    return {
        "hash fields": sorted(hash_),
        "status": hash_[b"status"],
        "mlxq_state": hash_[b"mlxq_state"],
        "job expires": conn.ttl(job.key),
        "result entries": 1 + len(more),
        "result fields": list(fields),
        "result type": fields[b"type"],
        "result worker": fields[b"worker_name"],
        "result execution": fields[b"execution_id"] == execution.id.encode(),
        "result expires": conn.ttl(rq_keys.results_key(job.id)),
        "finished": job.id in FinishedJobRegistry("ends", connection=conn).get_job_ids(),
        "still started": conn.zscore(
            StartedJobRegistry("ends", connection=conn).key, execution.composite_key
        ),
        "execution kept": conn.exists(rq_keys.execution_key(job.id, execution.id)),
        "executions": conn.zcard(rq_keys.executions_key(job.id)),
        "in worker's executions": conn.sismember(
            execution.worker_executions_key, execution.composite_key
        ),
    }


@pytest.mark.parametrize("result_ttl", [keys.DEFAULT_RESULT_TTL, -1])
def test_a_finished_job_ends_as_rq_ends_it(conn: redis.Redis, result_ttl: int) -> None:
    batch, worker, ((a, qa, ea), (b, qb, eb)) = _started(conn, 2, result_ttl)
    with conn.pipeline() as pipe:  # job a through RQ's objects (the transaction's way)
        transitions.end_job(pipe, a, qa, _result(a), worker=worker, execution=ea)
        pipe.execute()
    assert end_script.end_finished(worker, [end_script.Ending(b, qb, eb, _result(b))]) == [True]

    ours, rqs = _state(conn, b, eb, worker), _state(conn, a, ea, worker)
    assert ours == rqs
    assert ours["status"] == b"finished" and not ours["still started"]
    assert ours["result worker"] == b"w1"
    if result_ttl == -1:
        assert conn.ttl(rq_keys.results_key(b.id)) == -1 and conn.ttl(b.key) == -1
    # RQ and mlxq read it back
    fetched = Job.fetch(b.id, connection=conn, serializer=serializer)
    assert fetched.get_status() == JobStatus.FINISHED
    latest = fetched.latest_result()
    assert latest is not None and latest.type == RQResult.Type.SUCCESSFUL
    assert msgspec.convert(latest.return_value, Result) == _result(b)
    raw = conn.xrange(rq_keys.results_key(b.id))[0][1][b"return_value"]
    assert serializer.loads(base64.b64decode(raw))["text"] == "ok"
    assert [r.text for r in batches.iter_batch_results(conn, batch)] == ["ok", "ok"]
    status = batches.batch_status(conn, batch)
    assert (status.finished, status.started) == (2, 0), status
    counts = conn.hgetall(worker.key)
    assert counts[b"successful_job_count"] == b"2"
    assert float(counts[b"total_working_time"]) > 0
    assert eb.id not in worker.executions


def test_a_job_another_worker_holds_now_is_left_alone(conn: redis.Redis) -> None:
    """The held check and the writes are one atomic step: a job whose execution left the
    started registry (swept and handed on) gets no result from this worker."""
    batch, worker, ((job, queue, execution),) = _started(conn, 1)
    conn.zrem(StartedJobRegistry("ends", connection=conn).key, execution.composite_key)
    before = conn.hgetall(job.key)
    ending = end_script.Ending(job, queue, execution, _result(job))
    assert end_script.end_finished(worker, [ending]) == [False]
    assert conn.hgetall(job.key) == before
    assert not conn.exists(rq_keys.results_key(job.id))
    assert batches.batch_status(conn, batch).started == 1


def test_only_finished_jobs_that_keep_their_hash_take_the_script() -> None:
    job = Job(id="x", connection=redis.Redis())
    assert end_script.applies(job, Result(job_id="x", custom_id=None, finish_reason="length"))
    for reason in ("error", "cancelled", "timeout", "expired"):
        assert not end_script.applies(job, Result(job_id="x", custom_id=None, finish_reason=reason))
    job.result_ttl = 0  # RQ deletes such a job at once: its own path does that
    assert not end_script.applies(job, Result(job_id="x", custom_id=None, finish_reason="stop"))


def test_a_job_whose_script_redis_refuses_leaves_the_others_ended(conn: redis.Redis) -> None:
    """Redis answers each job's script alone: one refused (here a key of the wrong type, as
    another writer could leave) comes back as its error, and the rest are ended."""
    _, worker, ((a, qa, ea), (b, qb, eb)) = _started(conn, 2)
    conn.set(rq_keys.results_key(a.id), "not a stream")
    endings = [end_script.Ending(j, qu, e, _result(j)) for j, qu, e in ((a, qa, ea), (b, qb, eb))]
    refused, ended = end_script.end_finished(worker, endings)
    assert isinstance(refused, redis.ResponseError) and "WRONGTYPE" in str(refused)
    assert ended is True
    assert Job.fetch(b.id, connection=conn, serializer=serializer).get_status() == "finished"
    assert eb.id not in worker.executions and ea.id in worker.executions
