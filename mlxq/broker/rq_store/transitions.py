"""How a job moves from one RQ state to another when a worker (or a sweeper) ends it, retries
it or puts it back: each write in one transaction with its batch counter. (Starting jobs,
and ending finished ones, are one server-side script each: ``start_script``,
``end_script``.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result as RQResult
from rq.utils import now, utcformat
from rq.worker import BaseWorker

from mlxq.broker import keys
from mlxq.broker.rq_store import ownership, rq_keys
from mlxq.broker.rq_store.counters import batch_of, move, rehome
from mlxq.broker.rq_store.rq_keys import (
    execution_key,
    executions_key,
    failed_key,
    finished_key,
    job_key,
    registry_score,
)
from mlxq.broker.rq_store.states import BUCKET_OF_REASON, STATUS_OF_REASON
from mlxq.wire import JobMeta, Result, Timing, Usage


def result_without_output(
    job: Job,
    reason: Any,
    error: str,
    *,
    model: str | None = None,
    worker: str | None = None,
    prompt_tokens: int = 0,
) -> Result:
    """The full result of a job that ends without generating (rejected, abandoned, cancelled
    while queued): who, when, and why, with no completion tokens (and its prompt's tokens
    where the worker counted them before refusing it)."""
    meta = _meta_of(job)
    enqueued = job.enqueued_at.timestamp() if job.enqueued_at else None
    started = job.started_at.timestamp() if job.started_at else None
    return Result(
        job_id=job.id,
        custom_id=meta.custom_id,
        finish_reason=reason,
        error=error,
        usage=Usage(prompt_tokens, 0, prompt_tokens),
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
    count: bool = True,
) -> None:
    """Queue in ``pipe`` the writes that end a job with ``result``: its RQ status and
    registry (by finish reason), the result as its RQ return value, its batch counter, and
    the cleanup of the worker's execution.

    ``count=False`` leaves the worker's job counters to the caller
    (:func:`count_ended`, once for many jobs).
    """
    status = STATUS_OF_REASON[result.finish_reason]
    ttl = job.get_result_ttl(keys.DEFAULT_RESULT_TTL)
    job.ended_at = now()
    move(pipe, job.id, batch_of(job), BUCKET_OF_REASON[result.finish_reason])
    # Only status and end time change here (RQ's own save rewrites, and recompresses,
    # the whole job payload: a third of a worker's time per job at wide batches).
    job._status = status
    pipe.hset(job.key, mapping={"status": status.value, "ended_at": utcformat(job.ended_at)})
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
    # The registries by key, one command each: RQ's FailedJobRegistry.add rewrites the whole
    # job (``Job.save``), which a job whose payload could not be read cannot do.
    registry = finished_key if status == JobStatus.FINISHED else failed_key
    if status == JobStatus.CANCELED:
        queue.canceled_job_registry.add(job, ttl, pipe)
    else:
        pipe.zadd(registry(job.origin or queue.name), {job.id: registry_score(ttl)})
    job.cleanup(ttl, pipeline=pipe, remove_from_queue=False)
    if worker is None:
        return
    if count:
        count_ended(pipe, worker, [(job, status)])
    worker.cleanup_execution(job, pipeline=pipe, execution=execution)


def count_ended(pipe: Any, worker: BaseWorker, ended: list[tuple[Job, JobStatus]]) -> None:
    """Queue in ``pipe`` the worker's RQ counters for jobs it ended: successes, failures and
    working time, one command each however many jobs."""
    done = sum(status == JobStatus.FINISHED for _, status in ended)
    failed = sum(status == JobStatus.FAILED for _, status in ended)
    working = sum(
        (job.ended_at - job.started_at).total_seconds()
        for job, _ in ended
        if job.started_at and job.ended_at
    )
    if done:
        pipe.hincrby(worker.key, "successful_job_count", done)
    if failed:
        pipe.hincrby(worker.key, "failed_job_count", failed)
    if working:
        pipe.hincrbyfloat(worker.key, "total_working_time", working)


def fail_or_retry(worker: BaseWorker, held: ownership.Held, result: Result) -> bool | None:
    """A failed run of a job this worker still holds: back on its queue if it has retries
    left (True), else ended with ``result`` (an error, False); one transaction either way.
    None when another worker took the job meanwhile (nothing written)."""
    job, queue, execution = held.job, held.queue, held.execution
    retry = job.should_retry

    def write(pipe: Any, _: ownership.Held) -> None:
        if retry:
            worker.cleanup_execution(job, pipeline=pipe, execution=execution)
            worker.increment_failed_job_count(pipeline=pipe)
            move(pipe, job.id, batch_of(job), "queued")
            job.retry(queue, pipe)
        else:
            end_job(pipe, job, queue, result, worker=worker, execution=execution)

    return retry if ownership.write_if_held(worker.connection, [held], write)[0] else None


def give_back(worker: BaseWorker, items: Sequence[ownership.H]) -> list[bool]:
    """Put the jobs this worker still holds back at the front of their queues, in one
    transaction; for each, whether it was (False: another worker took it meanwhile, and
    it is left as that worker left it, never run again from here)."""

    def write(pipe: Any, held: ownership.Held) -> None:
        _put_back(pipe, worker, held.job, held.queue, held.execution)

    return ownership.write_if_held(worker.connection, items, write)


def redirect(worker: BaseWorker, items: Sequence[Redirected]) -> list[bool]:
    """Move jobs this worker still holds to the front of another queue (``item.to``), their
    ``origin`` and their batch's per-queue counters with them, in one transaction; for each,
    whether it was held (as :func:`give_back`)."""

    def write(pipe: Any, item: Redirected) -> None:
        job = item.job
        worker.cleanup_execution(job, pipeline=pipe, execution=item.execution)
        batch_id = batch_of(job)
        move(pipe, job.id, batch_id, "queued")
        if batch_id is not None:
            rehome(pipe, batch_id, item.queue.name, item.to)
        pipe.hset(job.key, mapping={"status": JobStatus.QUEUED.value, "origin": item.to})
        pipe.lpush(rq_keys.queue_key(item.to), job.id)

    return ownership.write_if_held(worker.connection, items, write)


class Redirected(ownership.Held, Protocol):
    """A held job to move to the queue ``to``."""

    to: str


def _put_back(pipe: Any, worker: BaseWorker, job: Job, queue: Queue, execution: Execution) -> None:
    """Queue in ``pipe`` returning a job this worker holds to the front of its queue."""
    worker.cleanup_execution(job, pipeline=pipe, execution=execution)
    move(pipe, job.id, batch_of(job), "queued")
    job.set_status(JobStatus.QUEUED, pipeline=pipe)
    pipe.lpush(queue.key, job.id)


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


def requeue_stranded_one(pipe: Any, queue: Queue, job_id: str, requeue: bool) -> None:
    """Queue in ``pipe`` taking a job id out of the intermediate queue (and the marks of
    when it was first seen there), and with ``requeue`` putting it back at the front of its
    queue: a job that still waits (its status and counters still say ``queued``)."""
    pipe.lrem(queue.intermediate_queue_key, 1, job_id)
    pipe.delete(keys.stranded(job_id), rq_keys.intermediate_first_seen_key(queue, job_id))
    if requeue:
        pipe.hset(job_key(job_id), "status", JobStatus.QUEUED.value)  # touches it for WATCH
        pipe.lpush(queue.key, job_id)
