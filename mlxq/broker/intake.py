"""Taking jobs from RQ queues: pull many per round trip, load them one by one, register
them, vet them.

Every pull moves an id into its queue's intermediate list (``rq_store.pull``), so a job is
always in a list that recovery sweeps, on any number of queues. A job whose hash cannot be
read fails alone (``rq_store.job_loading``). Nothing here deserializes a job's payload
before ``decode_job`` has checked it, and that check only ever decodes JSON (never pickle).
"""

from __future__ import annotations

import msgspec
from rq.exceptions import DeserializationError
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.worker import BaseWorker

from mlxq.broker import keys
from mlxq.broker.rq_store import internals, job_loading, pull, start_script
from mlxq.broker.rq_store.job_loading import Unreadable
from mlxq.wire import Request

Pulled = tuple[Job, Queue]


class JobRejected(Exception):
    """A job this worker will not run (not an mlxq job, or an invalid request)."""


def wait_for_job(
    worker: BaseWorker, timeout: float, max_bytes: int = keys.MAX_JOB_BYTES
) -> list[Pulled | Unreadable]:
    """Up to ``timeout`` seconds for one job on the worker's queues, in their order (empty
    if none came)."""
    found = pull.wait_move(worker.connection, internals.ordered_queues(worker), timeout)
    if found is None:
        return []
    queue, job_id = found
    return _load(worker, queue, [job_id], max_bytes)


def dequeue_many(
    worker: BaseWorker, n: int, max_bytes: int = keys.MAX_JOB_BYTES
) -> list[Pulled | Unreadable]:
    """Up to ``n`` jobs without blocking, in ``pull.take``'s order (RQ lists, then lanes by
    priority, equal batches in turn over all the queues), in a few round trips.

    Ids move to RQ's intermediate list until the job is registered, so a crash in between
    loses nothing; a job whose hash cannot be read comes back as an :class:`Unreadable`.
    The jobs are loaded a queue at a time but come back in the order taken: the engine
    admits them in that order, so the batches' turns hold when it cannot admit them all.
    """
    taken = pull.take(worker.connection, internals.ordered_queues(worker), n)
    found: list[Pulled | Unreadable | None] = [None] * len(taken)
    for queue in dict.fromkeys(q for q, _ in taken):
        at = [i for i, (q, _) in enumerate(taken) if q is queue]
        loaded = _load_each(worker, queue, [taken[i][1] for i in at], max_bytes)
        for i, item in zip(at, loaded, strict=True):
            found[i] = item
    return [item for item in found if item is not None]


def _load(
    worker: BaseWorker, queue: Queue, ids: list[str], max_bytes: int
) -> list[Pulled | Unreadable]:
    return [item for item in _load_each(worker, queue, ids, max_bytes) if item is not None]


def _load_each(
    worker: BaseWorker, queue: Queue, ids: list[str], max_bytes: int
) -> list[Pulled | Unreadable | None]:
    """Each id's job (None where it was deleted while queued: its id is dropped)."""
    out: list[Pulled | Unreadable | None] = []
    jobs = job_loading.load(worker.connection, queue, ids, max_bytes)
    for job_id, job in zip(ids, jobs, strict=True):
        if job is None:
            pull.drop_from_intermediate(worker.connection, queue, job_id)
        out.append(job if job is None or isinstance(job, Unreadable) else (job, queue))
    return out


def fail_unreadable(worker: BaseWorker, items: list[Unreadable]) -> None:
    """Fail each job that could not be read, alone, with its reason."""
    for item in items:
        job_loading.fail_unreadable(worker.connection, item, worker.name)


def register(worker: BaseWorker, group: list[Pulled]) -> list[Execution | str]:
    """Register jobs as this worker's RQ executions (status ``started``), atomically
    (:mod:`~mlxq.broker.rq_store.start_script`).

    For a job that is no longer waiting for this worker, why it was not started: cancelled
    meanwhile, or found stranded by a sweeper and put back on its queue (where another
    worker may already have it), or found in no list and put back.
    """
    return start_script.start_jobs(worker, group)


def _why_not_json(data: bytes, cause: BaseException | None) -> str:
    """What is wrong with a payload that does not decode, in a few words."""
    if data[:1] == b"\x80":
        return "a Python pickle, which mlxq never loads"
    if isinstance(cause, RecursionError):
        return "nested deeper than mlxq reads"
    if isinstance(cause, msgspec.DecodeError):
        return (
            f"{cause}; JSON has no NaN or Infinity"
            if b"NaN" in data or b"Inf" in data
            else str(cause)
        )
    return f"{type(cause).__name__}: {cause}" if cause else "unreadable"


def decode_job(job: Job) -> Request:
    """The job's request, refusing anything that is not a valid mlxq job."""
    try:
        func, instance, args, kwargs = job.func_name, job.instance, job.args, job.kwargs
    except DeserializationError as e:
        raise JobRejected(
            f"job payload is not mlxq's JSON ({_why_not_json(job.data, e.__cause__)}); "
            "refused unread. Submit with `mlxq submit` or the mlxq client"
        ) from e
    if func != keys.JOB_FUNC or instance is not None or kwargs or len(args) != 1:
        raise JobRejected(f"job calls {func!r}; mlxq workers only run {keys.JOB_FUNC}(request)")
    try:
        return msgspec.convert(args[0], Request)
    except msgspec.ValidationError as e:
        raise JobRejected(f"invalid request: {e}") from e
