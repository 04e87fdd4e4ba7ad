"""Taking jobs from RQ queues: dequeue many per round trip, register them, vet them.

Nothing here deserializes a job's payload before ``decode_job`` has checked it, and that
check only ever decodes JSON (never pickle).
"""

from __future__ import annotations

import msgspec
from rq.exceptions import DeserializationError
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.worker import BaseWorker

from mlxq.broker import keys
from mlxq.broker.rq_store import internals, start_script
from mlxq.wire import Request


class JobRejected(Exception):
    """A job this worker will not run (not an mlxq job, or an invalid request)."""


def dequeue_many(worker: BaseWorker, n: int) -> list[tuple[Job, Queue]]:
    """Up to ``n`` jobs without blocking, in queue order, in a few round trips.

    Ids move to RQ's intermediate queue (as RQ's own LMOVE dequeue does) until the job is
    registered, so a crash in between loses nothing.
    """
    out: list[tuple[Job, Queue]] = []
    for queue in internals.ordered_queues(worker):
        if len(out) >= n:
            break
        with worker.connection.pipeline(transaction=False) as pipe:
            for _ in range(n - len(out)):
                pipe.lmove(queue.key, queue.intermediate_queue_key)
            ids = [i.decode() for i in pipe.execute() if i is not None]
        if not ids:
            continue
        jobs = worker.job_class.fetch_many(ids, worker.connection, serializer=worker.serializer)
        for job_id, job in zip(ids, jobs, strict=True):
            if job is None:  # deleted while queued: drop its id
                worker.connection.lrem(queue.intermediate_queue_key, 1, job_id)
            else:
                out.append((job, queue))
    return out


def register(worker: BaseWorker, group: list[tuple[Job, Queue]]) -> list[Execution | None]:
    """Register jobs as this worker's RQ executions (status ``started``), atomically
    (:mod:`~mlxq.broker.rq_store.start_script`).

    None for a job that is no longer waiting for this worker: cancelled meanwhile, or found
    stranded by a sweeper (this worker took too long between dequeue and now) and put back
    on its queue, where another worker may already have it.
    """
    return start_script.start_jobs(worker, group)


def decode_job(job: Job) -> Request:
    """The job's request, refusing anything that is not a valid mlxq job."""
    try:
        func, instance, args, kwargs = job.func_name, job.instance, job.args, job.kwargs
    except DeserializationError as e:
        raise JobRejected(
            "job payload is not mlxq JSON; refusing it without deserializing "
            "(mlxq never loads pickle). Submit with `mlxq submit` or the mlxq client"
        ) from e
    if func != keys.JOB_FUNC or instance is not None or kwargs or len(args) != 1:
        raise JobRejected(f"job calls {func!r}; mlxq workers only run {keys.JOB_FUNC}(request)")
    try:
        return msgspec.convert(args[0], Request)
    except msgspec.ValidationError as e:
        raise JobRejected(f"invalid request: {e}") from e
