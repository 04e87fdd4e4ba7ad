"""What a worker owes Redis: stream output and ended jobs that are not written yet.

The MLX thread hands over finished jobs once; if Redis goes away mid-write they must not
be dropped (the engine has let go of them, and nothing else would ever end them). They wait
here, in order, and the next pass writes them once Redis is back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.worker import BaseWorker

from mlxq.broker import streams
from mlxq.engine.sampling import StreamChunk
from mlxq.wire import Result
from mlxq.worker.outcomes import InFlight, still_held, write_results


@dataclass
class Failure:
    """A registered job to fail (or retry) through RQ: a generation error, or a job refused
    at vetting (``reason`` is its category for the worker's counters)."""

    job: Job
    queue: Queue
    execution: Execution
    result: Result
    reason: str = "error"


class Writeback:
    """Stream chunks, stream end markers, failures and results waiting to be written."""

    def __init__(self) -> None:
        self.chunks: list[StreamChunk] = []
        self.stream_ends: list[tuple[str, str]] = []  # (job id, finish reason)
        self.failed: list[Failure] = []
        self.done: list[tuple[InFlight, Result]] = []

    def __len__(self) -> int:
        """Ended jobs still owed."""
        return len(self.failed) + len(self.done)

    def flush(self, worker: BaseWorker, fail: Callable[[Failure], None]) -> list[InFlight]:
        """Write everything owed; returns the jobs found handed to another worker (their late
        results are dropped). A Redis error propagates, with what is left kept for the next
        try: a write that landed before its reply was lost is found not held, never redone.
        """
        if self.chunks or self.stream_ends:
            streams.publish(worker.connection, self.chunks, self.stream_ends)
            self.chunks, self.stream_ends = [], []
        if self.failed:
            held = still_held(worker.connection, self.failed)  # one round trip for all
            for is_held in held:
                if is_held:
                    fail(self.failed[0])
                self.failed.pop(0)  # done: a Redis error in a later one keeps the rest
        lost = write_results(worker, self.done)
        self.done = []
        return lost
