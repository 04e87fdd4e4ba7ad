"""A worker's view of a Redis outage: how long to wait before the next try, and the log
lines an operator reads (when Redis went away, how many results wait, when it is back)."""

from __future__ import annotations

import logging
import time

MAX_BACKOFF_S = 30.0


class Outage:
    """Backoff between retries (doubling from half a second up to ``MAX_BACKOFF_S``)."""

    def __init__(self, log: logging.Logger, name: str) -> None:
        self.log, self.name = log, name
        self.backoff = 0.5
        self.since: float | None = None

    def lost(self, error: Exception, held: int) -> float:
        """Redis failed a pass: log it; the seconds to wait before the next."""
        wait = self.backoff
        self.since = self.since or time.monotonic()
        self.log.error(
            "Worker %s: Redis unreachable (%s); retrying in %.1fs, %d results held",
            self.name,
            error,
            wait,
            held,
        )
        self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)
        return wait

    def passed(self) -> None:
        """A pass went through: if Redis had been away, say it is back."""
        if self.since is not None:
            away = time.monotonic() - self.since
            self.log.info("Worker %s: Redis reachable again after %.0fs", self.name, away)
        self.backoff, self.since = 0.5, None
