"""What a worker checks about the jobs it holds, between steps of its loop: their heartbeats
(a job found handed to another worker meanwhile is dropped), cancel flags and time limits,
and an MLX thread that has stopped making progress."""

from __future__ import annotations

import time

import redis
from rq.utils import now
from rq.worker import BaseWorker

from mlxq.broker import keys
from mlxq.engine.runner import Runner
from mlxq.worker.outcomes import InFlight, still_held
from mlxq.worker.reporting import Reporter

# How long a stalled worker's record stays for `mlxq workers` after it exits.
STALLED_RECORD_TTL = 600


class EngineStalled(RuntimeError):
    """The MLX thread completed no step for ``stall_timeout`` seconds with jobs in flight."""


class EngineDied(RuntimeError):
    """The MLX thread stopped on an error (logged where it happened); the worker put its
    jobs back and exits non-zero."""


def beat(worker: BaseWorker, inflight: dict[str, InFlight], runner: Runner, ttl: int) -> None:
    """Refresh the worker's and every in-flight execution's heartbeat (``ttl`` seconds) in
    one round trip; jobs found handed to another worker meanwhile are dropped here."""
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
    for inf, ok in zip(items, held, strict=True):
        if not ok:
            worker.log.warning("Worker %s: lost job %s to another worker", worker.name, inf.job.id)
            inflight.pop(inf.job.id, None)
            runner.cancel(inf.job.id)


def stop_due(conn: redis.Redis, inflight: dict[str, InFlight], runner: Runner) -> None:
    """Stop jobs that were cancelled (`mlxq cancel`) or ran past their time limit."""
    items = list(inflight.values())
    flags = conn.mget([keys.cancel_flag(inf.job.id) for inf in items])
    for inf, flag in zip(items, flags, strict=True):
        if inf.stop_reason:
            continue
        if flag is not None:
            inf.stop_reason = "cancelled"
        elif inf.job.timeout and time.time() - inf.started_at > inf.job.timeout:
            inf.stop_reason = "timeout"
        if inf.stop_reason:
            runner.cancel(inf.job.id)


def step_age(runner: Runner, inflight: dict[str, InFlight]) -> float | None:
    """Seconds since the MLX thread's last completed pass, while jobs are in flight."""
    return time.monotonic() - runner.last_progress if inflight else None


def check_stall(runner: Runner, inflight: dict[str, InFlight], stall_timeout: float) -> None:
    """Give up on an MLX thread that has made no progress for ``stall_timeout`` s while
    jobs are in flight (hung in a native call: heartbeats alone would hold its jobs
    forever)."""
    age = step_age(runner, inflight)
    if age is not None and age >= stall_timeout:
        raise EngineStalled(
            f"the MLX thread completed no step for {age:.0f}s (--stall-timeout "
            f"{stall_timeout:g}) with {len(inflight)} jobs in flight; putting "
            "them back and exiting so the service manager restarts this worker"
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
