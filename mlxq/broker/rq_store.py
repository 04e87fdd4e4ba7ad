"""Everything mlxq knows about RQ, in one place: its key names, its job states, the private
attributes mlxq relies on, and every write that moves a job from one state to another.

Each state change also moves the job between its batch's counters (``keys.batch_counts``:
queued, started, finished, failed, cancelled, expired) in the same Redis transaction, so a
batch's status is one read however many jobs it has. The job's own hash remembers which
counter it is in (field ``mlxq_state``; none yet means queued), and a small script moves
it only if it changes, so a transition applied twice (two sweepers, a retried write)
counts once.

Every job that ends (finished, error, timeout, expired, cancelled) stores one full mlxq
``Result`` as its RQ result's return value, the same way, so readers never rebuild one.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import redis
from rq.defaults import RQ_KEY_PREFIX
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result as RQResult
from rq.utils import now
from rq.worker import BaseWorker

from mlxq.broker import keys
from mlxq.broker.serializer import serializer
from mlxq.wire import JobMeta, Result, Timing

CHUNK = 1000

# -- key names -------------------------------------------------------------------------
QUEUES_SET = Queue.redis_queues_keys  # every queue ever enqueued to


def job_key(job_id: str) -> str:
    """The job's hash (status, meta, payload, timestamps)."""
    return Job.key_for(job_id)


def queue_key(name: str) -> str:
    """The list of job ids waiting in a queue."""
    return Queue.redis_queue_namespace_prefix + name


def queue_name_of(key: str) -> str | None:
    """The queue name of a key from ``QUEUES_SET``, or None for anything else."""
    prefix = Queue.redis_queue_namespace_prefix
    return key[len(prefix) :] if key.startswith(prefix) else None


def results_key(job_id: str) -> str:
    """The stream of the job's RQ results (the latest is the one that counts)."""
    return RQResult.get_key(job_id)


def execution_key(job_id: str, execution_id: str) -> str:
    """One execution (a worker's run) of a job."""
    return f"{RQ_KEY_PREFIX}:execution:{job_id}:{execution_id}"


def executions_key(job_id: str) -> str:
    """The sorted set of a job's executions."""
    return f"{RQ_KEY_PREFIX}:executions:{job_id}"


def registry_keys(queue: str) -> tuple[str, str, str]:
    """(started, finished, failed) registry keys of a queue."""
    return (
        StartedJobRegistry.key_template.format(queue),
        FinishedJobRegistry.key_template.format(queue),
        FailedJobRegistry.key_template.format(queue),
    )


# -- job states ------------------------------------------------------------------------
# RQ's statuses, grouped as mlxq reads them. ``created`` is a job RQ made but has not
# queued yet; it never ran, so it is cancelled like a queued one.
WAITING = frozenset({"queued", "deferred", "scheduled", "created"})
RUNNING = frozenset({"started"})
ENDED = frozenset({"finished", "failed", "stopped", "canceled"})
GONE = "expired"  # the job's hash is no longer in Redis
# A batch's counters; every job is in exactly one.
BUCKETS = ("queued", "started", "finished", "failed", "cancelled", "expired")
# The counter of a job in each RQ status (for batches counted job by job).
BUCKET_OF_STATUS = {
    **dict.fromkeys(WAITING, "queued"),
    "started": "started",
    "finished": "finished",
    "failed": "failed",
    "stopped": "failed",
    "canceled": "cancelled",
    GONE: "expired",
}
# The RQ status and the counter a job ends in, by its result's finish reason.
STATUS_OF_REASON = {
    "stop": JobStatus.FINISHED,
    "length": JobStatus.FINISHED,
    "cancelled": JobStatus.CANCELED,
    "error": JobStatus.FAILED,
    "timeout": JobStatus.FAILED,
    "expired": JobStatus.FAILED,
}
BUCKET_OF_REASON = {
    "stop": "finished",
    "length": "finished",
    "cancelled": "cancelled",
    "error": "failed",
    "timeout": "failed",
    "expired": "expired",
}

# -- RQ internals mlxq relies on -------------------------------------------------------


def ordered_queues(worker: BaseWorker) -> list[Queue]:
    """The worker's queues in dequeue order (RQ keeps no public accessor)."""
    return worker._ordered_queues


# RQ's BaseWorker keeps its stop flag, signal set-up and pubsub error handler private; the
# batch loop needs them. (mlxq's worker also overrides BaseWorker._shutdown, the hook RQ's
# signal handler calls: check it too when upgrading RQ.)
def request_stop(worker: BaseWorker) -> None:
    """Ask the worker's loop to stop after this pass (what RQ's warm shutdown does)."""
    worker._stop_requested = True


def stop_requested(worker: BaseWorker) -> bool:
    """Whether a warm shutdown was asked for."""
    return bool(worker._stop_requested)


def install_signal_handlers(worker: BaseWorker) -> None:
    """RQ's SIGTERM/SIGINT handlers (warm shutdown, then a forced one)."""
    worker._install_signal_handlers()


def pubsub_error_handler(worker: BaseWorker) -> Any:
    """RQ's handler that keeps the command channel's thread alive through Redis errors."""
    return worker._pubsub_exception_handler


def _enqueue_again(queue: Queue, job: Job, pipe: Any, at_front: bool) -> None:
    """Put an existing job back on its queue (RQ's own requeue path, without its checks)."""
    queue._enqueue_job(job, pipeline=pipe, at_front=at_front)


# -- batch counters --------------------------------------------------------------------
# A job with no ``mlxq_state`` yet is in ``queued`` (where submit counts it). Batches
# without counters (made before they were kept) are left alone.
_MOVE = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then
  return 0
end
local old = redis.call('HGET', KEYS[1], 'mlxq_state') or 'queued'
if old == ARGV[1] then return 0 end
redis.call('HINCRBY', KEYS[2], old, -1)
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('HSET', KEYS[1], 'mlxq_state', ARGV[1])
return 1
"""


def batch_of(job: Job) -> str | None:
    """The mlxq batch a job belongs to (None for jobs pushed into RQ by other means)."""
    meta = job.meta if isinstance(job.meta, dict) else {}
    batch_id = meta.get("batch_id")
    return batch_id if isinstance(batch_id, str) else None


def move(pipe: Any, job_id: str, batch_id: str | None, bucket: str) -> None:
    """Queue, in ``pipe``'s transaction, moving the job to its batch's ``bucket`` counter."""
    if batch_id is None:
        return
    script = pipe.register_script(_MOVE)
    script(keys=[job_key(job_id), keys.batch_counts(batch_id)], args=[bucket])


def mark_submitted(pipe: Any, job_ids: Sequence[str], batch_id: str) -> None:
    """Count freshly enqueued jobs as queued (their hashes need no field for that)."""
    pipe.hincrby(keys.batch_counts(batch_id), "queued", len(job_ids))
    pipe.expire(keys.batch_counts(batch_id), keys.BATCH_TTL)


def read_counts(raw: dict[bytes, bytes]) -> dict[str, int]:
    """A batch's counters from its hash (missing ones are 0)."""
    got = {k.decode(): int(v) for k, v in raw.items()}
    return {b: got.get(b, 0) for b in BUCKETS}


# -- reading jobs ----------------------------------------------------------------------
def _chunks(items: Sequence[str], n: int = CHUNK) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), n):
        yield items[start : start + n]


def job_states(conn: redis.Redis, job_ids: Sequence[str]) -> list[str]:
    """RQ status of each job (``GONE`` when its hash is no longer there)."""
    states: list[str] = []
    for chunk in _chunks(job_ids):
        with conn.pipeline(transaction=False) as pipe:
            for jid in chunk:
                pipe.hget(job_key(jid), "status")
            states.extend(s.decode() if s else GONE for s in pipe.execute())
    return states


def job_exists(conn: redis.Redis, job_id: str) -> bool:
    """Whether RQ still has the job."""
    return bool(conn.exists(job_key(job_id)))


def job_status(conn: redis.Redis, job_id: str) -> str:
    """The job's RQ status, or ``GONE``."""
    raw = conn.hget(job_key(job_id), "status")
    return raw.decode() if raw else GONE


def job_metas(conn: redis.Redis, job_ids: Sequence[str]) -> list[JobMeta]:
    """The mlxq meta of each job (empty when gone or unreadable)."""
    with conn.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.hget(job_key(jid), "meta")
        return [_meta(raw) for raw in pipe.execute()]


def _meta(raw: bytes | None) -> JobMeta:
    try:
        return msgspec.convert(serializer.loads(raw or b"{}"), JobMeta)
    except (msgspec.MsgspecError, TypeError, ValueError):
        return JobMeta()


def read_results(conn: redis.Redis, job_ids: Sequence[str]) -> list[Result | None]:
    """The stored result of each job, or None while it has none (queued or running)."""
    with conn.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.hmget(job_key(jid), "status", "meta")
            pipe.xrevrange(results_key(jid), "+", "-", count=1)
        replies = pipe.execute()
    it = iter(replies)
    return [_result(jid, sm, latest) for jid, sm, latest in zip(job_ids, it, it, strict=False)]


def _result(job_id: str, status_meta: list, latest: list) -> Result | None:
    status = status_meta[0].decode() if status_meta[0] else GONE
    if status not in ENDED and status != GONE:
        return None  # queued, running, or waiting for a retry
    payload = latest[0][1] if latest else {}
    if b"return_value" in payload:
        data = serializer.loads(base64.b64decode(payload[b"return_value"]))
        return msgspec.convert(data, Result)
    return _unrecorded(job_id, status, _meta(status_meta[1]), payload)


_UNRECORDED = {
    "canceled": "cancelled before it finished",
    "stopped": "stopped before it finished",
    GONE: "the job expired from Redis before a result was collected",
    "failed": "failed without an error message",
}


def _unrecorded(job_id: str, status: str, meta: JobMeta, payload: dict) -> Result:
    """The result of a job that ended without one stored by mlxq: its hash expired, or RQ
    itself (or an older mlxq) ended it. Only what RQ kept can be said."""
    return Result(
        job_id=job_id,
        custom_id=meta.custom_id,
        finish_reason="cancelled" if status == "canceled" else "error",
        error=_failure_message(payload) or _UNRECORDED.get(status, status),
        batch_id=meta.batch_id,
        index=meta.index,
    )


def _failure_message(payload: dict) -> str | None:
    """The last line of an RQ failure's exception text (the message, not the traceback)."""
    raw = payload.get(b"exc_string")
    if not raw:
        return None
    text = zlib.decompress(base64.b64decode(raw)).decode(errors="replace").strip()
    return text.splitlines()[-1] if text else None


# -- writing state changes -------------------------------------------------------------
def result_without_output(
    job: Job, reason: Any, error: str, *, model: str | None = None, worker: str | None = None
) -> Result:
    """The full result of a job that ends without generating (rejected, abandoned, cancelled
    while queued): who, when, and why, with zero usage."""
    meta = _meta_of(job)
    enqueued = job.enqueued_at.timestamp() if job.enqueued_at else None
    started = job.started_at.timestamp() if job.started_at else None
    return Result(
        job_id=job.id,
        custom_id=meta.custom_id,
        finish_reason=reason,
        error=error,
        model=model,
        worker=worker,
        batch_id=meta.batch_id,
        index=meta.index,
        timing=Timing(enqueued_at=enqueued, started_at=started),
    )


def _meta_of(job: Job) -> JobMeta:
    try:
        return msgspec.convert(job.meta or {}, JobMeta)
    except msgspec.ValidationError:
        return JobMeta()


def end_job(
    pipe: Any,
    job: Job,
    queue: Queue,
    result: Result,
    *,
    worker: BaseWorker | None = None,
    execution: Execution | None = None,
) -> None:
    """Queue in ``pipe`` the writes that end a job with ``result``: its RQ status and
    registry (by finish reason), the result as its RQ return value, its batch counter, and
    the cleanup of the worker's execution."""
    status = STATUS_OF_REASON[result.finish_reason]
    ttl = job.get_result_ttl(keys.DEFAULT_RESULT_TTL)
    job.ended_at = now()
    move(pipe, job.id, batch_of(job), BUCKET_OF_REASON[result.finish_reason])
    job.set_status(status, pipeline=pipe)
    job.save(pipeline=pipe, include_meta=False, include_result=False)
    # Failures carry their error as RQ's exception text too, for RQ's own tools.
    failed = status == JobStatus.FAILED
    RQResult.create(
        job,
        RQResult.Type.FAILED if failed else RQResult.Type.SUCCESSFUL,
        ttl,
        return_value=msgspec.to_builtins(result),
        exc_string=(result.error or "failed") if failed else None,
        worker_name=result.worker or "",
        pipeline=pipe,
        execution_id=execution.id if execution else None,
        execution_started_at=execution.created_at if execution else None,
        execution_ended_at=job.ended_at,
    )
    if status == JobStatus.FINISHED:
        job.finished_job_registry.add(job, ttl, pipe)
    elif status == JobStatus.CANCELED:
        queue.canceled_job_registry.add(job, ttl, pipe)
    else:
        job.failed_job_registry.add(job, ttl, exc_string=result.error or "", pipeline=pipe)
    job.cleanup(ttl, pipeline=pipe, remove_from_queue=False)
    if worker is None:
        return
    if status == JobStatus.FINISHED:
        worker.increment_successful_job_count(pipeline=pipe)
    elif status == JobStatus.FAILED:
        worker.increment_failed_job_count(pipeline=pipe)
    if job.started_at:
        worker.increment_total_working_time(job.ended_at - job.started_at, pipe)
    worker.cleanup_execution(job, pipeline=pipe, execution=execution)


def fail_or_retry(
    worker: BaseWorker, job: Job, queue: Queue, execution: Execution, result: Result
) -> bool:
    """A failed run of a job: back on its queue if it has retries left (True), else ended
    with ``result`` (an error). One transaction either way."""
    retry = job.should_retry
    with worker.connection.pipeline() as pipe:
        if retry:
            worker.cleanup_execution(job, pipeline=pipe, execution=execution)
            worker.increment_failed_job_count(pipeline=pipe)
            move(pipe, job.id, batch_of(job), "queued")
            job.retry(queue, pipe)
        else:
            end_job(pipe, job, queue, result, worker=worker, execution=execution)
        pipe.execute()
    return retry


def put_back(pipe: Any, worker: BaseWorker, job: Job, queue: Queue, execution: Execution) -> None:
    """Queue in ``pipe`` returning a job this worker holds to the front of its queue."""
    worker.cleanup_execution(job, pipeline=pipe, execution=execution)
    move(pipe, job.id, batch_of(job), "queued")
    job.set_status(JobStatus.QUEUED, pipeline=pipe)
    pipe.lpush(queue.key, job.id)


def start_jobs(pipe: Any, worker: BaseWorker, group: list[tuple[Job, Queue]]) -> list[Execution]:
    """Queue in ``pipe`` RQ's prepare_execution + prepare_job_execution for many jobs.

    (RQ's own version also reads ``job.func_name`` for the process title, which would
    deserialize a hostile payload before it has been vetted.)
    """
    executions = []
    for job, queue in group:
        ttl = worker.get_heartbeat_ttl(job)
        execution = Execution.create(job, ttl, pipeline=pipe, worker_name=worker.name)
        worker.executions[execution.id] = execution
        executions.append(execution)
        job.heartbeat(now(), ttl, pipeline=pipe)
        move(pipe, job.id, batch_of(job), "started")
        job.prepare_for_execution(worker.name, pipeline=pipe)
        pipe.persist(job.key)
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
    return executions


def drop_execution(pipe: Any, registry_key: str, member: str, job_id: str, execution_id: str):
    """Queue in ``pipe`` forgetting a dead worker's execution of a job."""
    pipe.zrem(registry_key, member)
    pipe.delete(execution_key(job_id, execution_id))
    pipe.zrem(executions_key(job_id), execution_id)


def requeue_abandoned_one(pipe: Any, queue: Queue, job_id: str, batch_id: str | None) -> None:
    """Queue in ``pipe`` putting an abandoned job back at the front of its queue."""
    move(pipe, job_id, batch_id, "queued")
    pipe.hset(job_key(job_id), "status", JobStatus.QUEUED.value)
    pipe.lpush(queue.key, job_id)


def batch_id_of(conn: Any, job_id: str) -> str | None:
    """The batch of a job, read from its hash."""
    return _meta(conn.hget(job_key(job_id), "meta")).batch_id


def cancel_waiting(conn: redis.Redis, job_ids: Sequence[str]) -> int:
    """Cancel, through RQ, every job among ``job_ids`` that is still waiting to run; each
    stores a ``cancelled`` result. Returns how many. A job a worker takes meanwhile is left
    to that worker (the check and the cancel are one optimistic transaction)."""
    cancelled = 0
    for chunk in _chunks(job_ids, 500):
        states = job_states(conn, chunk)
        waiting = [jid for jid, s in zip(chunk, states, strict=True) if s in WAITING]
        if waiting:
            cancelled += _cancel_chunk(conn, waiting)
    return cancelled


def _cancel_chunk(conn: redis.Redis, job_ids: list[str]) -> int:
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(*[job_key(j) for j in job_ids])
                jobs = Job.fetch_many(job_ids, connection=conn, serializer=serializer)
                still = [
                    j for j in jobs if j is not None and j.get_status(refresh=False) in WAITING
                ]
                pipe.multi()
                for job in still:
                    job.cancel(pipeline=pipe)
                    result = result_without_output(job, "cancelled", "cancelled before it started")
                    queue = Queue(job.origin, connection=conn, serializer=serializer)
                    end_job(pipe, job, queue, result)
                pipe.execute()
                return len(still)
            except redis.WatchError:
                pipe.reset()  # a worker took one meanwhile: look again


def retry_failed(conn: redis.Redis, job_ids: Sequence[str]) -> int:
    """Put the failed jobs among ``job_ids`` back on their queues; returns how many."""
    count = 0
    for jid, state in zip(job_ids, job_states(conn, job_ids), strict=True):
        if state == "failed" and _retry_one(conn, jid):
            count += 1
    return count


def _retry_one(conn: redis.Redis, job_id: str) -> bool:
    with conn.pipeline() as pipe:
        try:
            pipe.watch(job_key(job_id))
            job = Job.fetch(job_id, connection=conn, serializer=serializer)
            if job.get_status(refresh=False) != JobStatus.FAILED:
                return False
            queue = Queue(job.origin, connection=conn, serializer=serializer)
            job.started_at = job.ended_at = None
            pipe.multi()
            pipe.zrem(job.failed_job_registry.key, job.id)
            move(pipe, job.id, batch_of(job), "queued")
            _enqueue_again(queue, job, pipe, at_front=False)
            pipe.execute()
            return True
        except redis.WatchError:
            return False  # changed meanwhile (retried by someone else)
