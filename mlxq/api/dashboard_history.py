"""The fleet's tokens/s over the last ten minutes, as ``mlxq dashboard`` saw it.

Every couple of seconds the dashboard sums the rate each live worker publishes
(``WorkerInfo.recent_tps``: tokens of the jobs it finished over the last minute, 0 once it
is idle) and keeps the samples in fixed time bins; a bin's rate is the mean of its samples.
The chart is that history with the bin now filling as its last bar, so the rate shown as
"now" is always among what the chart draws. The peak is the highest rate sampled in the
window (or "now"), not the highest bar: a rate once shown as "now" stays the peak even when
idle samples later share its bin and pull the bar's mean down. Only what this process saw
is kept: bins from before it started, or while Redis could not be read, are ``None`` (no
data), not zero.
"""

from __future__ import annotations

import threading

import msgspec

WINDOW_S = 600.0
BIN_S = 10.0


class Throughput(msgspec.Struct):
    """Tokens/s per ``bin_s`` bin, oldest first: the complete bins of the window, then the
    bin now filling (its samples so far); ``None`` where nothing was sampled. ``now_tps``
    is the live workers' own rate summed now; ``peak_tps`` the highest of the samples in the
    window and ``now_tps`` (never below a bar)."""

    bin_s: float
    rates: list[float | None]
    now_tps: float
    peak_tps: float


class RateHistory:
    """Bins of the fleet's sampled tokens/s, fed by :meth:`sample`. Thread-safe."""

    def __init__(self, window_s: float = WINDOW_S, bin_s: float = BIN_S) -> None:
        self.bin_s = bin_s
        self.bins = int(window_s // bin_s)
        # bin index -> (sum of rates, samples, highest sample)
        self._bins: dict[int, tuple[float, int, float]] = {}
        self._lock = threading.Lock()

    def sample(self, tps: float, at: float) -> None:
        """Record the fleet's rate ``tps`` as seen at ``at`` (monotonic seconds)."""
        index = int(at // self.bin_s)
        with self._lock:
            total, n, high = self._bins.get(index, (0.0, 0, tps))
            self._bins[index] = (total + tps, n + 1, max(high, tps))
            for old in [i for i in self._bins if i < index - self.bins]:
                del self._bins[old]

    def series(self, at: float, now_tps: float) -> Throughput:
        """The last ``window`` of complete bins before ``at``, then ``at``'s own bin."""
        current = int(at // self.bin_s)
        with self._lock:
            sums = [self._bins.get(i) for i in range(current - self.bins, current + 1)]
        rates = [None if s is None else s[0] / s[1] for s in sums]
        peak = max([now_tps, *(s[2] for s in sums if s is not None)])
        return Throughput(self.bin_s, rates, now_tps, peak)
