"""The fleet's tokens/s over the last ten minutes, as ``mlxq dashboard`` saw it.

Workers publish a running count of the tokens they generated (``tokens_generated``) with
every heartbeat; the dashboard samples them and puts each worker's increase since its last
sample into fixed time bins. Only what this process saw is counted: bins from before it
started, or while Redis could not be read, are ``None`` (no data), not zero.
"""

from __future__ import annotations

import threading

import msgspec

from mlxq.wire import WorkerInfo

WINDOW_S = 600.0
BIN_S = 10.0


class Throughput(msgspec.Struct):
    """Tokens/s per ``bin_s`` bin, oldest first, ending at the last complete bin; ``None``
    where nothing was sampled. ``now_tps`` is the live workers' own recent rate."""

    bin_s: float
    rates: list[float | None]
    now_tps: float


class TokenHistory:
    """Bins of generated tokens, fed by :meth:`sample`. Thread-safe."""

    def __init__(self, window_s: float = WINDOW_S, bin_s: float = BIN_S) -> None:
        self.bin_s = bin_s
        self.bins = int(window_s // bin_s)
        self._tokens: dict[int, int] = {}  # bin index -> tokens seen generated in it
        self._last: dict[tuple[str, float], int] = {}  # (worker, started_at) -> its count
        self._lock = threading.Lock()

    def sample(self, workers: list[WorkerInfo], at: float) -> None:
        """Count what each worker generated since its previous sample into ``at``'s bin.

        A worker seen for the first time (or restarted: a new ``started_at``) only sets
        its baseline: when it generated its earlier tokens is unknown.
        """
        index = int(at // self.bin_s)
        with self._lock:
            added = 0
            seen: dict[tuple[str, float], int] = {}
            for w in workers:
                key = (w.name, w.started_at)
                before = self._last.get(key)
                if before is not None and w.tokens_generated >= before:
                    added += w.tokens_generated - before
                seen[key] = w.tokens_generated
            self._last = seen
            self._tokens[index] = self._tokens.get(index, 0) + added
            for old in [i for i in self._tokens if i < index - self.bins]:
                del self._tokens[old]

    def series(self, at: float, workers: list[WorkerInfo]) -> Throughput:
        """The last ``window`` of complete bins before ``at``."""
        current = int(at // self.bin_s)
        with self._lock:
            counts = [self._tokens.get(i) for i in range(current - self.bins, current)]
        rates = [None if n is None else n / self.bin_s for n in counts]
        return Throughput(self.bin_s, rates, sum(w.recent_tps for w in workers))
