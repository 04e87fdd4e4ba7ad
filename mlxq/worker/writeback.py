"""What a worker owes Redis: stream output and ended jobs that are not written yet.

The MLX thread hands over finished jobs once; if Redis goes away mid-write they must not
be dropped (the engine has let go of them, and nothing else would ever end them). They wait
here, in order, and the next pass writes them once Redis is back.
"""

from __future__ import annotations

from collections.abc import Callable

from rq.worker import BaseWorker

from mlxq.broker import streams
from mlxq.engine.sampling import StreamChunk
from mlxq.wire import Result
from mlxq.worker.outcomes import InFlight, still_held, write_results


class Writeback:
    """Stream chunks, stream end markers, failures and results waiting to be written."""

    def __init__(self) -> None:
        self.chunks: list[StreamChunk] = []
        self.stream_ends: list[tuple[str, str]] = []  # (job id, finish reason)
        self.failed: list[tuple[InFlight, Result]] = []  # generation errors, via RQ's retry
        self.done: list[tuple[InFlight, Result]] = []

    def __len__(self) -> int:
        """Ended jobs still owed."""
        return len(self.failed) + len(self.done)

    def flush(self, worker: BaseWorker, fail: Callable[[InFlight, Result], None]) -> list[InFlight]:
        """Write everything owed; returns the jobs found handed to another worker (their late
        results are dropped). A Redis error propagates, with what is left kept for the next
        try: a write that landed before its reply was lost is found not held, never redone.
        """
        if self.chunks or self.stream_ends:
            streams.publish(worker.connection, self.chunks, self.stream_ends)
            self.chunks, self.stream_ends = [], []
        while self.failed:
            inf, result = self.failed[0]
            if still_held(worker.connection, [inf])[0]:
                fail(inf, result)
            self.failed.pop(0)
        lost = write_results(worker, self.done)
        self.done = []
        return lost
