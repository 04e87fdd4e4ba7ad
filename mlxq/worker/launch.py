"""Wiring a worker together: profile → configuration and engine on the MLX thread →
scheduler → RQ worker."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from mlxq.broker import fleet
from mlxq.engine.factory import make_engine
from mlxq.engine.hardware import DeviceFacts
from mlxq.engine.protocol import BatchEngine
from mlxq.engine.runner import Runner
from mlxq.engine.scheduler import Scheduler
from mlxq.errors import StartupError, one_line
from mlxq.wire import ModelInfo, Result
from mlxq.worker import sharing
from mlxq.worker.config import WorkerConfig, queues_by_model, worker_queues
from mlxq.worker.model_set import ModelSet
from mlxq.worker.profile import WorkerProfile
from mlxq.worker.reporting import Reporter
from mlxq.worker.rq_worker import MlxqWorker
from mlxq.worker.switching import ModelSwitcher

if TYPE_CHECKING:  # the metrics extra is imported only when --metrics-port asks for it
    from mlxq.worker.metrics import WorkerMetrics

log = logging.getLogger("mlxq.worker")

__all__ = ["Setup", "build_scheduler", "engine_for", "run_worker", "worker_queues"]


class Setup:
    """Starting a worker's engine: the models are found (hub ids downloaded) and checked on
    the calling thread, so a model that cannot load fails in one line before anything is
    served; then the MLX thread loads the first, resolves the configuration (the device and
    the model are known only then) and builds the engine and the scheduler from it. A
    worker of several models builds the next one's the same way (:meth:`switch_to`).

    ``conn``: the Redis whose live workers on this host share its memory (read here, before
    the model loads; see :mod:`mlxq.worker.sharing`)."""

    def __init__(self, profile: WorkerProfile, conn: redis.Redis | None = None) -> None:
        if not profile.model:
            raise ValueError("no model: pass --model (a local folder or a hub id) or a --profile")
        self.profile, self.conn = profile, conn
        queues_by_model(profile)  # several models of one queue name: refused before loading
        self.models = ModelSet(profile)
        if conn is not None:  # found and checked: announced to `mlxq api` while it loads
            with contextlib.suppress(redis.RedisError):
                queues = list(worker_queues(profile))
                fleet.announce(conn, profile.served(), queues, profile.adapter_path)
            # Its memory claimed before it loads: workers of this host that claimed first
            # load first, and this one sizes itself from what they hold (``sharing``).
            self.models.starting = tuple(self._claim(profile, conn))
            self.models.neighbours = self.neighbours = sharing.neighbours(conn)
        else:
            self.neighbours = []
        self.config: WorkerConfig | None = None  # set on the MLX thread: the loaded model's
        self._sized: list[WorkerConfig] = []  # the configurations whose sizing was logged
        self.runner = Runner(self._engine, self._scheduler)

    @staticmethod
    def _claim(profile: WorkerProfile, conn: redis.Redis) -> list[sharing.Starting]:
        """This worker's memory claim, and the claims of the others loading (none where
        Redis refuses the write: a full Redis, which the worker then waits for)."""
        try:
            return sharing.claim_start(conn, _claim_name(profile), profile.memory_fraction)
        except redis.ResponseError as e:
            log.warning("could not claim this worker's memory share before loading: %s", e)
            return []

    def start(self) -> WorkerConfig:
        """Start the MLX thread, load and warm up the model; the resolved configuration.
        What it holds is claimed for its host at once (``sharing.claim_loaded``)."""
        self.runner.start()
        assert self.config is not None
        if self.conn is not None:
            with contextlib.suppress(redis.RedisError):
                fraction, held = self.profile.memory_fraction, self.config.claimed_bytes
                sharing.claim_loaded(self.conn, _claim_name(self.profile), fraction, held)
        return self.config

    def switch_to(self, model: str) -> Future[ModelInfo]:
        """Run ``model`` instead of the loaded one: its engine is built on the MLX thread
        (the running engine must have finished its jobs); ``config`` is the new model's
        once the future is done."""
        return self.runner.replace(lambda facts: self._build(model, facts))

    def _build(self, model: str, facts: DeviceFacts) -> tuple[BatchEngine, Scheduler]:
        engine = self._engine(facts, model)
        return engine, self._scheduler(engine, facts)

    def _engine(self, facts: DeviceFacts, model: str | None = None) -> BatchEngine:
        name = model or self.profile.model or ""
        loaded, tokenizer, self.config = self.models.prepare(name, facts)
        return engine_for(loaded, tokenizer, self.config)

    def _scheduler(self, engine: BatchEngine, facts: DeviceFacts) -> Scheduler:
        assert self.config is not None
        first = self.config not in self._sized  # a model switched back to is not logged again
        if first:  # (not once per switch: a long-lived worker switches without end)
            self._sized.append(self.config)
        return build_scheduler(self.config, log_sizing=first)


def _claim_name(profile: WorkerProfile) -> str:
    """The name a starting worker's memory claim shows (its own, or its pid)."""
    return profile.name or f"pid {os.getpid()}"


def engine_for(
    loaded: Any, tokenizer: Any, config: WorkerConfig, engine: str | None = None
) -> BatchEngine:
    """A warmed-up engine over a loaded model, sized as the configuration says: the slot
    engine where the model's cache allows (``engine`` overrides, see
    :mod:`mlxq.engine.factory`)."""
    made = make_engine(
        loaded, tokenizer, config.model, engine=engine or config.engine, **engine_sizes(config)
    )
    made.warmup()
    return made


def engine_sizes(config: WorkerConfig) -> dict[str, Any]:
    """The engine options a configuration sets (a pipeline divides some by its ranks)."""
    return {
        # The engine's own cap stays as before; the scheduler admits config.max_batch.
        "max_batch": config.engine_max_batch,
        "prefill_batch": config.prefill_batch,
        "prefill_step": config.prefill_step,
        "prefill_tokens": config.prefill_tokens if config.auto_prefill else None,
        "prefix_cache_bytes": config.prefix_cache_bytes,
        "kv_bits": config.kv_bits,
    }


def build_scheduler(config: WorkerConfig, log_sizing: bool = True) -> Scheduler:
    """The scheduler of a configuration (logging the device and model it was sized for)."""
    if log_sizing:
        _log_sizing(config)
    return Scheduler(
        max_batch=config.max_batch,
        kv_bytes_per_token=config.info.kv_bytes_per_token,
        budget_bytes=config.kv_budget_bytes,
        context_length=config.info.context_length,
        prefetch=config.prefill_batch,
        auto_prefill=config.auto_prefill,
        prefill_step=config.prefill_step,
        prefill_tokens=config.prefill_tokens,
    )


def _log_sizing(config: WorkerConfig) -> None:
    facts, info = config.facts, config.info
    log.info(
        "device: %s %s on %s (%s), %.1f GiB memory, KV budget %.1f GiB + prefix cache %.1f GiB",
        facts.backend,
        facts.name,
        facts.host,
        facts.os,
        facts.memory_bytes / 2**30,
        config.kv_budget_bytes / 2**30,
        config.prefix_cache_bytes / 2**30,
    )
    room = config.share
    if room is not None and room.crowded:
        log.info(
            "memory: %s; this worker holds %.1f GiB (weights + KV budget + prefix cache)",
            room.describe(),
            config.claimed_bytes / 2**30,
        )
    log.info(
        "model: %s (%s, %d layers, hidden %d, %d KV heads x %d, vocab %d, context %d, %s), "
        "%.2f GiB weights, %d KiB KV per token%s; batch up to %d",
        info.name,
        info.model_type,
        info.num_layers,
        info.hidden_size,
        info.num_kv_heads,
        info.head_dim,
        info.vocab_size,
        info.context_length,
        info.dtype,
        info.param_bytes / 2**30,
        info.kv_bytes_per_token // 1024,
        f" ({config.kv_bits}-bit cache)" if config.kv_bits else "",
        config.max_batch,
    )


def run_worker(
    profile: WorkerProfile,
    conn: redis.Redis,
    *,
    burst: bool = False,
    queues: list[str] | None = None,
    on_finish: Callable[[Result], None] | None = None,
    log_level: str = "INFO",
    setup: Setup | None = None,
) -> MlxqWorker:
    """Load the model, then serve ``queues`` until stopped (or empty, with ``burst``).

    ``setup`` is an already started :class:`Setup` (``mlxq run`` loads the model before it
    submits anything); without one, the model is loaded here.
    """
    metrics = _serve_metrics(profile)
    if setup is None:
        setup = Setup(profile, conn)
        setup.start()
    config, runner = setup.config, setup.runner
    assert config is not None
    worker = MlxqWorker(
        queues or list(config.queues),
        connection=conn,
        runner=runner,
        model_name=config.model,
        name=config.name,
        abandon_after=config.abandon_after,
        max_job_bytes=config.max_job_bytes,
        max_result_bytes=profile.max_result_bytes,
        grace_period=config.grace_period,
        stall_timeout=config.stall_timeout,
        keep_awake=profile.keep_awake,
    )
    worker.on_finish = on_finish
    worker.reporter = _reporter(worker, config, metrics, profile.served())
    if len(profile.served()) > 1:
        served = msgspec.structs.replace(profile, queues=queues) if queues else profile
        worker.switcher = ModelSwitcher(setup, queues_by_model(served), profile.min_model_seconds)
        worker.switcher.start(worker)
    try:
        worker.work(burst=burst, logging_level=log_level)
    finally:
        if not worker.stalled:  # a hung MLX thread never joins
            runner.stop()
    return worker


def _serve_metrics(profile: WorkerProfile) -> WorkerMetrics | None:
    """Prometheus metrics on ``profile.metrics_port``, if asked for (before the model
    loads, so a missing extra or a busy port fails at once)."""
    if profile.metrics_port is None:
        return None
    from mlxq.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    try:
        metrics.serve(profile.metrics_port)
    except OSError as e:
        raise StartupError(
            f"cannot serve metrics on port {profile.metrics_port} ({one_line(e)}): pick "
            "a free --metrics-port (or metrics_port in the profile)"
        ) from e
    log.info("metrics on http://0.0.0.0:%d/metrics", metrics.port)
    return metrics


def _reporter(
    worker: MlxqWorker,
    config: WorkerConfig,
    metrics: WorkerMetrics | None,
    models: list[str] | None = None,
) -> Reporter:
    return Reporter(
        worker.name,
        config.model,
        worker.queue_names(),
        config.facts,
        config.adapter_path,
        metrics,
        claimed_bytes=config.claimed_bytes,
        models=models,
    )
