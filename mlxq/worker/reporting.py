"""What a worker tells the world: its WorkerInfo in Redis (``mlxq workers``) and, when
asked for, Prometheus metrics. Fed by the worker loop; touches no MLX state."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from mlxq.broker import fleet
from mlxq.broker.rq_store import lanes
from mlxq.engine.hardware import DeviceFacts
from mlxq.engine.scheduler import Scheduler
from mlxq.wire import Result, WorkerInfo

if TYPE_CHECKING:  # the metrics extra is imported only where --metrics-port asks for it
    from mlxq.worker.metrics import WorkerMetrics

# A worker that holds no job and ended none for this long generates nothing now: its
# published rate is 0, not the tail of its last minute's average (a few seconds' grace,
# so a worker between two batches of short jobs does not flicker to 0).
IDLE_AFTER_S = 5.0
REPORT_INTERVAL_S = 2.0  # how often a worker publishes its state (WorkerInfo, metrics)


class Reporter:
    """Counts a worker's work and publishes it with each heartbeat."""

    def __init__(
        self,
        name: str,
        model: str,
        queues: list[str],
        facts: DeviceFacts,
        adapter_path: str | None = None,
        metrics: WorkerMetrics | None = None,
        claimed_bytes: int = 0,
        models: list[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.model, self.queues = name, model, queues
        self.models = models if models and len(models) > 1 else []  # a worker of several
        self.claimed_bytes = claimed_bytes  # weights + caches: what it holds of the memory
        self.facts, self.adapter_path, self.metrics = facts, adapter_path, metrics
        self._clock = clock
        self.rate = fleet.RecentRate(clock=clock)
        self._last_end = float("-inf")  # (clock) when a job last ended with tokens
        self.done = self.failures = self.tokens = 0
        self.started_at = time.time()
        self._last_report = float("-inf")  # (monotonic) when it last published
        self._set_info()

    def _set_info(self) -> None:
        if self.metrics is not None:
            facts = self.facts
            device = f"{facts.backend} {facts.name}"
            self.metrics.set_info(model=self.model, device=device, host=facts.host)

    def switched(self, old: str, new: str, claimed_bytes: int, load_s: float) -> None:
        """The worker's loaded model changed from ``old`` to ``new`` (in ``load_s`` s)."""
        self.model, self.claimed_bytes = new, claimed_bytes
        self._set_info()
        if self.metrics is not None:
            self.metrics.model_switched(old, new, load_s)

    def finished(self, result: Result) -> None:
        """A job ended with a result (any finish reason)."""
        self.done += 1
        self.tokens += result.usage.completion_tokens
        self.rate.add(result.usage.completion_tokens)
        if result.usage.completion_tokens > 0:
            self._last_end = self._clock()
        if self.metrics is not None:
            self.metrics.job_finished(result)

    def recovered(self, how: str, job_ids: list[str]) -> None:
        """Jobs this worker's sweep put back on their queues (``metrics.RECOVERED``)."""
        if self.metrics is not None:
            self.metrics.jobs_recovered(how, len(job_ids))

    def taken_over(self, n: int) -> None:
        """Jobs this worker held that another worker took back meanwhile (dropped here)."""
        if self.metrics is not None:
            self.metrics.jobs_taken_over(n)

    def failed(self, reason: str) -> None:
        """A job failed without a result (rejected, or an error); ``reason`` is a category."""
        self.failures += 1
        if self.metrics is not None:
            self.metrics.job_failed(reason)

    def publish_if_due(self, conn: redis.Redis, *args: Any, force: bool = False, **kw: Any):
        """:meth:`publish` every ``REPORT_INTERVAL_S``, or now with ``force``."""
        if not force and time.monotonic() - self._last_report < REPORT_INTERVAL_S:
            return
        self._last_report = time.monotonic()
        self.publish(conn, *args, **kw)

    def publish(
        self,
        conn: redis.Redis,
        scheduler: Scheduler,
        in_flight: int,
        ttl: int,
        memory: tuple[int, int] = (0, 0),
        state: str = "running",
        step_age_s: float | None = None,
    ) -> None:
        """Refresh WorkerInfo in Redis (expiring after ``ttl`` s) and the metric gauges."""
        info = self.info(scheduler, in_flight)
        info.state, info.step_age_s = state, step_age_s
        fleet.publish(conn, info, ttl)
        if self.metrics is None:
            return
        self.metrics.set_in_flight(in_flight)
        self.metrics.set_kv(scheduler.reserved_bytes, scheduler.budget_bytes)
        self.metrics.set_memory(*memory)
        for q, depth in lanes.waiting(conn, self.queues).items():  # RQ lists and lanes
            self.metrics.set_queue_depth(q, depth)

    def recent_tps(self, in_flight: int) -> float:
        """Tokens/s of the jobs it finished over the last minute; 0 once it holds no job
        and none ended for ``IDLE_AFTER_S`` (it generates nothing now)."""
        now = self._clock()
        if in_flight == 0 and now - self._last_end >= IDLE_AFTER_S:
            return 0.0
        return self.rate.rate(now)

    def info(self, scheduler: Scheduler, in_flight: int) -> WorkerInfo:
        """This worker's state now."""
        return WorkerInfo(
            name=self.name,
            host=socket.gethostname(),
            pid=os.getpid(),
            model=self.model,
            queues=self.queues,
            backend=self.facts.backend,
            device=self.facts.name,
            memory_bytes=self.facts.memory_bytes,
            max_batch=scheduler.max_batch,
            kv_budget_bytes=scheduler.budget_bytes,
            kv_reserved_bytes=scheduler.reserved_bytes,
            in_flight=in_flight,
            decoding=scheduler.active,
            jobs_done=self.done,
            jobs_failed=self.failures,
            tokens_generated=self.tokens,
            recent_tps=self.recent_tps(in_flight),
            started_at=self.started_at,
            heartbeat_at=time.time(),
            adapter_path=self.adapter_path,
            memory_claimed_bytes=self.claimed_bytes,
            memory_domain=self.facts.memory_domain,
            models=self.models,
        )
