"""Ending finished jobs with one server-side script each: what :func:`transitions.end_job`
writes through RQ's objects for a job that finished (RQ 3.0's keys and fields), and the
check that this worker still holds the job, in one atomic step with no WATCH.

Through RQ's objects a finished job costs about 13 commands, each with its reply to parse
inside a transaction, and RQ's Python around them: 256 jobs ending in one decode step took
the worker's thread 34 ms on a 2-core CPU while the device waited; one ``EVALSHA`` a job
takes 18 ms (half of it the server's own work). Anything else (failures, cancels, a result
TTL of 0, which deletes the job) still goes through RQ's objects.

What the script assumes: the job's execution (``job_id:execution_id``) is still in its
queue's started registry. Where it is not, a sweeper took the job back (this worker missed
its heartbeats: the job waits or runs elsewhere) and the late result is dropped; where
something else took the entry (RQ's own registry cleanup, a person), the job is left
``started`` in no registry, which ``unaccounted`` puts back on its queue: it runs again, it
is never lost.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
import redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result as RQResult
from rq.utils import now, utcformat
from rq.worker import BaseWorker

from mlxq.broker import keys
from mlxq.broker.rq_store.counters import batch_of, move_step_lua
from mlxq.broker.rq_store.rq_keys import (
    execution_key,
    executions_key,
    finished_key,
    job_key,
    registry_score,
    results_key,
    started_key,
)
from mlxq.broker.rq_store.states import STATUS_OF_REASON
from mlxq.broker.serializer import serializer
from mlxq.wire import Result

# KEYS: 1 started registry, 2 job hash, 3 result stream, 4 finished registry, 5 execution,
# 6 the job's executions, 7 the worker's executions, 8 dependents, 9 dependencies,
# 10 batch counters (its hash, or the job's own hash again when the job has no batch),
# 11 the worker's hash (its job counters). ARGV: 1 composite execution key, 2 execution
# id, 3 job id, 4 ended_at, 5 result TTL, 6 registry score, 7 "1" when counted in a
# batch, 8 working seconds (or ""), 9.. the result entry's fields.
_END = (
    """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
"""
    + move_step_lua("KEYS[2]", "KEYS[10]", "'finished'", when="ARGV[7] == '1'")
    + """
redis.call('HSET', KEYS[2], 'status', 'finished', 'ended_at', ARGV[4])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 10, '*', unpack(ARGV, 9))
local ttl = tonumber(ARGV[5])
if ttl == -1 then redis.call('PERSIST', KEYS[3]) else redis.call('EXPIRE', KEYS[3], ttl) end
redis.call('ZADD', KEYS[4], ARGV[6], ARGV[3])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('EXPIRE', KEYS[8], ttl)
  redis.call('EXPIRE', KEYS[9], ttl)
end
redis.call('DEL', KEYS[5])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[2])
redis.call('SREM', KEYS[7], ARGV[1])
redis.call('HINCRBY', KEYS[11], 'successful_job_count', 1)
if ARGV[8] ~= '' then redis.call('HINCRBYFLOAT', KEYS[11], 'total_working_time', ARGV[8]) end
return 1
"""
)


@dataclass
class Ending:
    """A finished job to end: its queue and execution, and its result."""

    job: Job
    queue: Queue
    execution: Execution
    result: Result


def applies(job: Job, result: Result) -> bool:
    """Whether the script ends this job: it finished, and its result TTL keeps the job."""
    return (
        STATUS_OF_REASON[result.finish_reason] == JobStatus.FINISHED
        and job.get_result_ttl(keys.DEFAULT_RESULT_TTL) != 0
    )


def end_finished(worker: BaseWorker, endings: Sequence[Ending]) -> list[bool | redis.ResponseError]:
    """End each job (see the module docstring) and count it in the worker's RQ counters, in
    one round trip; for each, whether it was still this worker's (a job handed to another
    worker meanwhile is left untouched), or the error Redis refused its script with (a
    full Redis, a job's key of the wrong type: the others are ended all the same)."""
    if not endings:
        return []
    with worker.connection.pipeline(transaction=False) as pipe:
        script = pipe.register_script(_END)
        for e in endings:
            keys_, args = _call(e, worker)
            script(keys=keys_, args=args)
        replies = pipe.execute(raise_on_error=False)
    done = [r if isinstance(r, redis.ResponseError) else bool(r) for r in replies]
    for e, ok in zip(endings, done, strict=True):
        if ok is True:
            e.job._status = JobStatus.FINISHED
            worker.executions.pop(e.execution.id, None)
    return done


def _call(e: Ending, worker: BaseWorker) -> tuple[list[str], list[Any]]:
    """The script's keys and arguments for one job (as end_job's writes)."""
    job, execution = e.job, e.execution
    ttl = job.get_result_ttl(keys.DEFAULT_RESULT_TTL)
    job.ended_at = now()
    batch_id = batch_of(job)
    hash_key = job_key(job.id)
    queue = job.origin or e.queue.name
    keys_ = [
        started_key(queue),
        hash_key,
        results_key(job.id),
        finished_key(queue),
        execution_key(job.id, execution.id),
        executions_key(job.id),
        execution.worker_executions_key,
        job.dependents_key,
        job.dependencies_key,
        keys.batch_counts(batch_id) if batch_id else hash_key,
        worker.key,
    ]
    working = (job.ended_at - job.started_at).total_seconds() if job.started_at else 0
    entry = _result_entry(e.result, execution, job.ended_at)
    args = [
        execution.composite_key,
        execution.id,
        job.id,
        utcformat(job.ended_at),
        ttl,
        registry_score(ttl),
        "1" if batch_id else "0",
        working or "",
        *entry,
    ]
    return keys_, args


def _result_entry(result: Result, execution: Execution, ended: datetime) -> list[Any]:
    """RQ's stored result of a successful run (``rq.results.Result.serialize``), flat."""
    value = serializer.dumps(msgspec.to_builtins(result))
    return [  # (the same values as RQ's: redis-py encodes them alike either way)
        "type",
        RQResult.Type.SUCCESSFUL.value,
        "worker_name",
        result.worker or "",
        "return_value",
        base64.b64encode(value).decode(),
        "execution_id",
        execution.id,
        "execution_started_at",
        execution.created_at.timestamp(),
        "execution_ended_at",
        ended.timestamp(),
    ]
