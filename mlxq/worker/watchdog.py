"""What a worker checks about the jobs it holds, between steps of its loop: their heartbeats
(a job found handed to another worker meanwhile is dropped), cancel flags and time limits,
and an MLX thread that has stopped making progress."""

from __future__ import annotations

import time

import redis
from rq.utils import now
from rq.worker import BaseWorker

from mlxq.broker import keys
from mlxq.broker.rq_store.ownership import still_held
from mlxq.engine.runner import Runner
from mlxq.worker.outcomes import InFlight
from mlxq.worker.reporting import Reporter

CONTROL_INTERVAL_S = 0.5  # how often cancel flags and time limits are checked
# A loop pass takes at most about a second (a blocking pull); a gap this long between two
# looks means the whole process was stopped or asleep, not busy.
FROZEN_GAP_S = 5.0
# How long a stalled worker's record stays for `mlxq workers` after it exits.
STALLED_RECORD_TTL = 600


class EngineStalled(RuntimeError):
    """The MLX thread completed no step for ``stall_timeout`` seconds with jobs in flight."""


class EngineDied(RuntimeError):
    """The MLX thread stopped on an error (logged where it happened); the worker put its
    jobs back and exits non-zero."""


def beat(
    worker: BaseWorker, inflight: dict[str, InFlight], runner: Runner, ttl: int
) -> list[InFlight]:
    """Refresh the worker's and every in-flight execution's heartbeat (``ttl`` seconds) in
    one round trip; jobs found handed to another worker meanwhile are dropped here (and
    returned)."""
    items = list(inflight.values())
    held = still_held(worker.connection, items)
    with worker.connection.pipeline() as pipe:
        worker.heartbeat(worker.job_monitoring_interval + 60, pipeline=pipe)
        stamp = now()
        for inf, ok in zip(items, held, strict=True):
            if ok:
                inf.execution.heartbeat(inf.job.started_job_registry, ttl, pipeline=pipe)
                inf.job.heartbeat(stamp, ttl, pipeline=pipe, xx=True)
        pipe.execute()
    lost = [inf for inf, ok in zip(items, held, strict=True) if not ok]
    for inf in lost:
        inflight.pop(inf.job.id, None)
        runner.cancel(inf.job.id)
    return lost


def stop_due(conn: redis.Redis, inflight: dict[str, InFlight], runner: Runner) -> None:
    """Stop jobs that were cancelled (`mlxq cancel`: the job's own flag, or its batch's,
    one key for all of a batch's jobs) or ran past their time limit, in one round trip.
    A batch cancelled with ``drain`` (the API's expiry) lets its running jobs finish."""
    items = list(inflight.values())
    batch_ids = list(dict.fromkeys(b for inf in items if (b := inf.meta.batch_id)))
    flags = conn.mget(
        [keys.cancel_flag(inf.job.id) for inf in items]
        + [keys.batch_cancelled(b) for b in batch_ids]
    )
    stopped = {b for b, f in zip(batch_ids, flags[len(items) :], strict=True) if f == b"stop"}
    for inf, flag in zip(items, flags[: len(items)], strict=True):
        if inf.stop_reason:
            continue
        if flag is not None or inf.meta.batch_id in stopped:
            inf.stop_reason = "cancelled"
        elif inf.job.timeout and time.time() - inf.started_at > inf.job.timeout:
            inf.stop_reason = "timeout"
        if inf.stop_reason:
            runner.cancel(inf.job.id)


class Awake:
    """Notices that this whole process did not run for a while: stopped (SIGSTOP, a
    debugger) or its machine asleep. The MLX thread was frozen with it, so its silence over
    that time is no stall; and the jobs it held may have been handed to other workers."""

    def __init__(self) -> None:
        self.since = time.monotonic()  # when it last woke (or started)
        self._seen_wall, self._seen_mono = time.time(), time.monotonic()

    def woke(self) -> float | None:
        """Seconds this process did not run since the last call, if over ``FROZEN_GAP_S``.
        (Both clocks: a Mac's monotonic clock stops while it sleeps, its wall clock not.)"""
        wall, mono = time.time(), time.monotonic()
        gap = max(wall - self._seen_wall, mono - self._seen_mono)
        self._seen_wall, self._seen_mono = wall, mono
        if gap < FROZEN_GAP_S:
            return None
        self.since = mono
        return gap


def step_age(
    runner: Runner, inflight: dict[str, InFlight], awake: Awake | None = None
) -> float | None:
    """Seconds since the MLX thread's last completed pass (or since this process woke, if
    later), while it has work: the worker's jobs in flight, jobs it let go of that the MLX
    thread has not yet dropped (a thread hung in a native call never does), or a call into
    the engine not yet returned (:attr:`~mlxq.engine.runner.Runner.holds_work`)."""
    if not inflight and not runner.holds_work:
        return None
    return time.monotonic() - max(runner.last_progress, awake.since if awake else 0.0)


def check_stall(
    runner: Runner, inflight: dict[str, InFlight], stall_timeout: float, awake: Awake
) -> None:
    """Give up on an MLX thread that has made no progress for ``stall_timeout`` s while it
    has work (:func:`step_age`; hung in a native call: heartbeats alone would hold its jobs
    forever, and a worker holding none would sit there broken)."""
    age = step_age(runner, inflight, awake)
    if age is None or age < stall_timeout:
        return
    held = (
        f"with {len(inflight)} jobs in flight; putting them back"
        if inflight
        else "with no job in flight (hung in a call into MLX or to its other ranks)"
    )
    raise EngineStalled(
        f"the MLX thread completed no step for {age:.0f}s (--stall-timeout "
        f"{stall_timeout:g}) {held}; exiting so the service manager restarts this worker"
    )


def record_stall(
    reporter: Reporter,
    conn: redis.Redis,
    runner: Runner,
    inflight: dict[str, InFlight],
    abandon_after: int,
) -> None:
    """Leave a ``stalled`` record for `mlxq workers` (kept at least ``abandon_after`` s)."""
    if runner.scheduler is None:
        return
    try:
        reporter.publish(
            conn,
            runner.scheduler,
            len(inflight),
            ttl=max(STALLED_RECORD_TTL, abandon_after),
            state="stalled",
            step_age_s=step_age(runner, inflight),
        )
    except redis.RedisError:
        pass  # the record expires by itself


class Watchdog:
    """The worker loop's checks on the jobs it holds, each when due: heartbeats (every
    ``beat_every`` s), cancel flags and time limits (every ``CONTROL_INTERVAL_S``), a wake-up
    after the whole process was stopped or asleep, and a hung MLX thread."""

    def __init__(self, worker: BaseWorker, runner: Runner, ttl: int, stall_timeout: float):
        self.worker, self.runner, self.ttl = worker, runner, ttl
        self.stall_timeout = stall_timeout
        self.awake = Awake()
        self._last_beat = self._last_control = 0.0

    def beat_soon(self) -> None:
        """Heartbeat at the next look (back from an outage, or awake again)."""
        self._last_beat = 0.0

    def beat_if_due(self, inflight: dict[str, InFlight]) -> list[InFlight]:
        """Heartbeat when due (:func:`beat`); the jobs found handed to another worker."""
        interval = self.worker.job_monitoring_interval
        if time.monotonic() - self._last_beat < interval:
            return []
        self._last_beat = time.monotonic()
        return beat(self.worker, inflight, self.runner, self.ttl)

    def control_if_due(self, inflight: dict[str, InFlight]) -> None:
        """Stop cancelled and timed-out jobs when due (:func:`stop_due`)."""
        if not inflight or time.monotonic() - self._last_control < CONTROL_INTERVAL_S:
            return
        self._last_control = time.monotonic()
        stop_due(self.worker.connection, inflight, self.runner)

    def woke(self, inflight: dict[str, InFlight]) -> bool:
        """Whether this process just woke from a stop or a sleep (said in one line); its
        next look heartbeats at once, and the MLX thread gets a fresh stall window."""
        gap = self.awake.woke()
        if gap is None:
            return False
        self.worker.log.warning(
            "Worker %s: this process did not run for %.0fs (stopped, or its machine slept); "
            "checking which of its %d jobs it still holds",
            self.worker.name,
            gap,
            len(inflight),
        )
        self.beat_soon()
        return True

    def check_stall(self, inflight: dict[str, InFlight]) -> None:
        """:func:`check_stall` with this worker's timeout, from its last wake-up on."""
        check_stall(self.runner, inflight, self.stall_timeout, self.awake)

    def step_age(self, inflight: dict[str, InFlight]) -> float | None:
        """:func:`step_age`, from its last wake-up on."""
        return step_age(self.runner, inflight, self.awake)
