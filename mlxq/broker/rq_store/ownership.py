"""Writes a worker makes only while it still holds a job: ending it, failing or retrying
it, putting it back on its queue.

A worker holds a job while its execution (``job_id:execution_id``) is in the queue's
started registry. A worker that slept (a closed lid, SIGSTOP) past ``--abandon-after``
finds on waking that a sweeper took its executions out and put the jobs back, and that
another worker may have started or even finished them since. Whatever it then writes about
those jobs (a late result, a failure, a put-back) would run them twice or overwrite the
other worker's outcome, so every such write is checked and made in one step.

What this relies on (RQ 3.0 and mlxq's own scripts): everything that takes a job from a
worker or starts it elsewhere writes the job's hash in the same atomic step (the
sweepers' requeue, the start and end scripts, the unaccounted sweep), so a WATCH on the
job's hash sees any change of hands between the check and the writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import redis
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue


class Held(Protocol):
    """A job this worker registered: the job, its queue and its RQ execution."""

    job: Job
    queue: Queue
    execution: Execution


H = TypeVar("H", bound=Held)


def still_held(conn: redis.Redis, items: Sequence[Held]) -> list[bool]:
    """Whether each job's execution is still registered as running (one round trip)."""
    with conn.pipeline(transaction=False) as pipe:
        for i in items:
            pipe.zscore(i.queue.started_job_registry.key, i.execution.composite_key)
        return [score is not None for score in pipe.execute()]


def write_if_held(
    conn: redis.Redis,
    items: Sequence[H],
    write: Callable[[Any, H], None],
    after: Callable[[Any, list[H]], None] | None = None,
) -> list[bool]:
    """Queue ``write(pipe, item)`` for each item this worker still holds, and
    ``after(pipe, held_items)`` once, all in one transaction that no change of hands can
    slip into (a WATCH on the jobs' hashes, retried when one changed). Returns, for each
    item, whether it was held (and so written)."""
    if not items:
        return []
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(*{i.job.key for i in items})
                # (Read on another connection, after the WATCH: one round trip for all.)
                held = still_held(conn, items)
                pipe.multi()
                kept = [i for i, ok in zip(items, held, strict=True) if ok]
                for item in kept:
                    write(pipe, item)
                if after is not None:
                    after(pipe, kept)
                pipe.execute()
                return held
            except redis.WatchError:
                pipe.reset()  # a job changed hands meanwhile: check again
