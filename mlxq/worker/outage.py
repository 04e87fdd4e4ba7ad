"""A worker's view of a Redis that does not serve it: away (backoff, and the log lines an
operator reads: when Redis went away, how many results wait, when it is back), refusing
writes (full under ``noeviction``, or read-only), or set to evict keys (checked every
``CHECK_INTERVAL_S``: the worker takes no new jobs until it is fixed)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from mlxq.broker.eviction import ServerLimits, eviction_problem, server_limits

MAX_BACKOFF_S = 30.0
CHECK_INTERVAL_S = 30.0  # how often a running worker reads the server's policy and limits
# Redis refusing every write, not one job's: full (maxmemory under noeviction), read-only.
WRITE_REFUSALS = (redis.OutOfMemoryError, redis.ReadOnlyError)


def refuses_writes(error: redis.ResponseError) -> bool:
    """Whether Redis refuses every write, not one job's: full (``maxmemory`` reached under
    ``noeviction``), a read-only replica, or failing to persist (MISCONF)."""
    return isinstance(error, WRITE_REFUSALS) or str(error).startswith("MISCONF")


def _refusal_hint(error: redis.ResponseError) -> str:
    if isinstance(error, redis.OutOfMemoryError):
        return (
            "Redis is full (used memory over its maxmemory; noeviction refuses writes): free "
            "memory (delete finished batches, shorten result TTLs) or raise it with "
            "`CONFIG SET maxmemory <bytes>`"
        )
    if isinstance(error, redis.ReadOnlyError):
        return "Redis is a read-only replica: point the worker at the primary"
    return f"Redis refuses writes ({error}): see its log"


def while_refused(call: Callable[[], object], outage: Outage) -> None:
    """Run ``call``, again after each back-off while Redis refuses writes."""
    while True:
        try:
            call()
            return
        except redis.ResponseError as e:
            if not refuses_writes(e):
                raise
            time.sleep(outage.refused(e, 0))


class Outage:
    """Backoff between retries (doubling from half a second up to ``MAX_BACKOFF_S``)."""

    def __init__(self, log: logging.Logger, name: str) -> None:
        self.log, self.name = log, name
        self.backoff = 0.5
        self.since: float | None = None
        self.refusing = False

    def lost(self, error: Exception, held: int) -> float:
        """Redis failed a pass: log it; the seconds to wait before the next."""
        self.log.error(
            "Worker %s: Redis unreachable (%s); retrying in %.1fs, %d results held",
            self.name,
            error,
            self.backoff,
            held,
        )
        return self._wait()

    def refused(self, error: redis.ResponseError, held: int) -> float:
        """Redis refused a write of the pass (see :func:`refuses_writes`): log what to do;
        the seconds to wait before the next (no new jobs are taken meanwhile)."""
        self.refusing = True
        self.log.error(
            "Worker %s: %s; %d results held, no new jobs taken, retrying in %.1fs",
            self.name,
            _refusal_hint(error),
            held,
            self.backoff,
        )
        return self._wait()

    def _wait(self) -> float:
        wait = self.backoff
        self.since = self.since or time.monotonic()
        self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)
        return wait

    def passed(self) -> None:
        """A pass went through: if Redis had been away, say it is back."""
        if self.since is not None:
            away = time.monotonic() - self.since
            what = "accepting writes" if self.refusing else "reachable"
            self.log.info("Worker %s: Redis %s again after %.0fs", self.name, what, away)
        self.backoff, self.since, self.refusing = 0.5, None, False


class ServerWatch:
    """The server's eviction policy and limits, read every ``CHECK_INTERVAL_S``: an evicting
    policy set under a running worker (which silently deletes jobs and results) pauses its
    intake, with an error line saying what to fix, until the policy is ``noeviction`` again."""

    def __init__(self, log: logging.Logger, name: str) -> None:
        self.log, self.name = log, name
        self.paused = False
        self.limits: ServerLimits | None = None
        self._checked_at: float | None = None

    def check_if_due(self, conn: redis.Redis) -> bool:
        """Read the server when due; whether it was read (``limits`` and ``paused`` new)."""
        now = time.monotonic()
        if self._checked_at is not None and now - self._checked_at < CHECK_INTERVAL_S:
            return False
        self._checked_at = now
        self.limits = server_limits(conn)
        where = conn.connection_pool.connection_kwargs
        problem = eviction_problem(
            self.limits.policy, where.get("host", "HOST"), where.get("port", 6379)
        )
        was_paused, self.paused = self.paused, problem is not None
        if problem is not None:
            self.log.error("Worker %s: taking no new jobs: %s", self.name, problem)
        elif was_paused:
            policy = self.limits.policy
            self.log.info("Worker %s: maxmemory-policy is %s again: taking jobs", self.name, policy)
        return True
