"""Queue I/O: submitting batches as RQ jobs and reading their state and results back.

Every request is one RQ job on a named queue (so ``rq info``, RQ's registries and
``Job.fetch`` see it). A submit's jobs form a batch whose job ids are kept, in input
order, under ``keys.batch_jobs``. All Redis traffic here is pipelined in chunks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import redis
from rq import Queue

from mlxq.broker import keys, routing
from mlxq.broker.batch_record import (
    CHUNK,
    BatchNotFound,
    batch_job_ids,
    decode_info,
    get_batch,
    iter_job_id_chunks,
    new_batch_id,
)
from mlxq.broker.rq_store import cancel_retry, counters, reads, states
from mlxq.broker.serializer import serializer
from mlxq.broker.submission import (
    BatchCancelled,
    ResumeRefused,
    requests_digest,
    resume,
    submit,
)
from mlxq.wire import BatchStatus, Result


def connect(url: str) -> redis.Redis:
    """A Redis client for ``url`` (``redis://``, ``rediss://`` or ``unix://``)."""
    if url.startswith("unix://"):  # TCP keepalive does not apply to a socket file
        return redis.Redis.from_url(url, health_check_interval=30)
    return redis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)


def make_queue(conn: redis.Redis, name: str) -> Queue:
    """An RQ queue using mlxq's JSON serializer (never pickle)."""
    return Queue(name, connection=conn, serializer=serializer)


def job_states(conn: redis.Redis, job_ids: Sequence[str]) -> list[str]:
    """RQ status of each job (``expired`` when its hash is gone)."""
    return reads.job_states(conn, job_ids)


def batch_status(conn: redis.Redis, batch_id: str) -> BatchStatus:
    """Counts of the batch's jobs by state: one round trip, whatever the batch's size."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.get(keys.batch_info(batch_id))
        pipe.hgetall(keys.batch_counts(batch_id))
        pipe.llen(keys.batch_jobs(batch_id))
        pipe.exists(keys.batch_submitter(batch_id))
        raw, counts, enqueued, alive = pipe.execute()
    if raw is None:
        get_batch(conn, batch_id)  # raises BatchNotFound
    info = decode_info(raw)
    c = counters.read_counts(counts) if counts or not enqueued else count_jobs(conn, batch_id)
    return BatchStatus(
        batch_id=batch_id,
        total=info.total,
        queued=c["queued"],
        started=c["started"],
        finished=c["finished"],
        failed=c["failed"] + c["expired"],
        cancelled=c["cancelled"],
        expired=c["expired"],
        state=info.state,
        enqueued=enqueued,
        submitter_alive=bool(alive) and info.state == "submitting",
        models=routing.progress(info, counts),
        priority=info.priority,
    )


def count_jobs(conn: redis.Redis, batch_id: str) -> dict[str, int]:
    """A batch's counts read job by job (batches made before counters were kept)."""
    counts = dict.fromkeys(states.BUCKETS, 0)
    for ids in iter_job_id_chunks(conn, batch_id):
        for state in reads.job_states(conn, ids):
            counts[states.BUCKET_OF_STATUS.get(state, "failed")] += 1
    return counts


def fetch_results(conn: redis.Redis, job_ids: Sequence[str]) -> list[Result | None]:
    """The result of each job, or None while it has none yet (queued or running)."""
    out: list[Result | None] = []
    for start in range(0, len(job_ids), CHUNK):
        out.extend(reads.read_results(conn, job_ids[start : start + CHUNK]))
    return out


def iter_batch_results(conn: redis.Redis, batch_id: str) -> Iterator[Result | None]:
    """The batch's results in input order; None for jobs not done yet. Streams: a chunk
    of ids and results in memory at a time."""
    get_batch(conn, batch_id)
    for ids in iter_job_id_chunks(conn, batch_id):
        yield from reads.read_results(conn, ids)


def wait_for_batch(
    conn: redis.Redis,
    batch_id: str,
    *,
    timeout: float | None = None,
    poll: float = 0.5,
    on_progress: Callable[[BatchStatus], None] | None = None,
) -> BatchStatus:
    """Poll until every job of the batch is done (or ``timeout`` seconds pass)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = _retrying(lambda: batch_status(conn, batch_id))
        if on_progress:
            on_progress(status)
        if status.done + status.other >= status.total:
            return status
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(
                f"batch {batch_id}: {status.done} of {status.total} done after {timeout:g}s "
                f"(is a worker running on queue {get_batch(conn, batch_id).queue!r}?)"
            )
        time.sleep(poll)


def _retrying(fn: Callable, attempts: int = 8):
    """Call ``fn``, riding out Redis restarts and dropped connections with backoff."""
    delay = 0.5
    for attempt in range(attempts):
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError):
            if attempt == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
    raise AssertionError("unreachable")


def cancel_jobs(
    conn: redis.Redis, job_ids: Sequence[str], from_lanes: bool = True
) -> tuple[int, int]:
    """Cancel jobs: waiting ones leave their queue (and, with ``from_lanes``, their lane) at
    once (their results say cancelled), running ones are flagged and stopped by their
    worker at its next check. Returns (dequeued, flagged)."""
    dequeued, running = cancel_retry.cancel_now(conn, job_ids, from_lanes)
    if running:
        cancel_retry.flag_running(conn, job_ids)
    return dequeued, running


def cancel_batch(conn: redis.Redis, batch_id: str, stop_running: bool = True) -> tuple[int, int]:
    """Cancel a batch: first, in one atomic step, it is flagged cancelled, its record says
    ``cancelled`` and its lanes are dropped (a submit still enqueueing it stops, and cannot
    be resumed); from then on no worker starts one of its jobs, and if ``stop_running`` its
    running jobs stop at their worker's next check (else they finish). Then its jobs still
    waiting anywhere are cancelled, a chunk at a time (``cancel_retry``). Idempotent: run
    again (or by several at once) it cancels what is left. A batch whose jobs have all
    ended is left as it is. Returns (dequeued, running: the jobs found running, stopping if
    ``stop_running``)."""
    if not batch_id or _all_ended(conn, batch_id):
        return 0, 0
    mode = cancel_retry.STOP if stop_running else cancel_retry.DRAIN
    cancel_retry.mark_cancelled(conn, batch_id, mode)
    dequeued = running = 0
    for ids in iter_job_id_chunks(conn, batch_id):
        d, r = cancel_retry.cancel_now(conn, ids, from_lanes=False)
        dequeued, running = dequeued + d, running + r
    return dequeued, running if stop_running else 0


def _all_ended(conn: redis.Redis, batch_id: str) -> bool:
    """Whether every job of a fully submitted batch has ended (a cancel has nothing to do,
    and its record stays ``submitted``); a batch cancelled before stays ``cancelled``."""
    try:
        s = batch_status(conn, batch_id)
    except BatchNotFound:
        return False
    return s.state == "submitted" and s.queued == 0 and s.started == 0 and s.enqueued >= s.total


def mark_cancelled(conn: redis.Redis, batch_id: str, stop_running: bool = True) -> None:
    """The first step of :func:`cancel_batch` alone, one script call: flagged cancelled,
    its record ``cancelled``, its lanes dropped. No worker starts a job of the batch after
    it; its waiting jobs stay to be cancelled (by :func:`cancel_batch`)."""
    mode = cancel_retry.STOP if stop_running else cancel_retry.DRAIN
    cancel_retry.mark_cancelled(conn, batch_id, mode)


def batch_cancelled(conn: redis.Redis, batch_id: str) -> bool:
    """Whether the batch was cancelled (no job of it starts any more)."""
    return bool(conn.exists(keys.batch_cancelled(batch_id)))


def retry_failed(conn: redis.Redis, job_ids: Sequence[str]) -> int:
    """Put the failed jobs among ``job_ids`` back on their queues; returns how many."""
    return cancel_retry.retry_failed(conn, job_ids)


# The batch record's and submitting's entry points are part of this module's API.
__all__ = [
    "CHUNK",
    "BatchCancelled",
    "BatchNotFound",
    "ResumeRefused",
    "batch_job_ids",
    "get_batch",
    "iter_job_id_chunks",
    "new_batch_id",
    "requests_digest",
    "resume",
    "submit",
]
