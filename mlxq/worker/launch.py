"""Wiring a worker together: profile → configuration and engine on the MLX thread →
scheduler → RQ worker."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx_lm
import redis

from mlxq.engine.hardware import DeviceFacts
from mlxq.engine.mlx_lm_batch import Engine
from mlxq.engine.model_facts import model_info
from mlxq.engine.runner import Runner
from mlxq.engine.scheduler import Scheduler
from mlxq.wire import Result
from mlxq.worker.config import WorkerConfig, resolve, worker_queues
from mlxq.worker.profile import WorkerProfile
from mlxq.worker.reporting import Reporter
from mlxq.worker.rq_worker import MlxqWorker

log = logging.getLogger("mlxq.worker")

__all__ = ["Setup", "build_scheduler", "engine_for", "run_worker", "worker_queues"]


class Setup:
    """What the MLX thread does at start: load the model, resolve the configuration once
    (the device and the model are known only then), build the engine and the scheduler."""

    def __init__(self, profile: WorkerProfile) -> None:
        if not profile.model:
            raise ValueError("no model: pass --model (a local folder or a hub id) or a --profile")
        self.profile = profile
        self.config: WorkerConfig | None = None  # set on the MLX thread

    def engine(self, facts: DeviceFacts) -> Engine:
        model = self.profile.model or ""
        loaded, tokenizer = mlx_lm.load(model, adapter_path=self.profile.adapter_path)
        info = model_info(loaded, model, vocab_size=len(tokenizer))
        self.config = resolve(self.profile, facts, info)
        return engine_for(loaded, tokenizer, self.config)

    def scheduler(self, engine: Engine, facts: DeviceFacts) -> Scheduler:
        assert self.config is not None
        return build_scheduler(self.config)

    def runner(self) -> Runner:
        """A Runner whose thread does all of the above when started."""
        return Runner(self.engine, self.scheduler)


def engine_for(loaded: Any, tokenizer: Any, config: WorkerConfig) -> Engine:
    """A warmed-up Engine over a loaded model, sized as the configuration says."""
    engine = Engine.from_loaded(
        loaded,
        tokenizer,
        config.model,
        max_batch=config.max_batch,
        prefill_batch=config.prefill_batch,
        prefill_step=config.prefill_step,
        prefix_cache_bytes=config.prefix_cache_bytes,
    )
    engine.warmup()
    return engine


def build_scheduler(config: WorkerConfig) -> Scheduler:
    """The scheduler of a configuration (logging the device and model it was sized for)."""
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
    log.info(
        "model: %s (%s, %d layers, hidden %d, %d KV heads x %d, vocab %d, context %d, %s), "
        "%.2f GiB weights, %d KiB KV per token; batch up to %d",
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
) -> MlxqWorker:
    """Load the model, then serve ``queues`` until stopped (or empty, with ``burst``)."""
    setup = Setup(profile)
    runner = setup.runner()
    runner.start()
    config = setup.config
    assert config is not None
    worker = MlxqWorker(
        queues or list(config.queues),
        connection=conn,
        runner=runner,
        model_name=config.model,
        name=config.name,
        abandon_after=config.abandon_after,
        grace_period=config.grace_period,
        stall_timeout=config.stall_timeout,
    )
    worker.on_finish = on_finish
    worker.reporter = _reporter(worker, config)
    try:
        worker.work(burst=burst, logging_level=log_level)
    finally:
        if not worker.stalled:  # a hung MLX thread never joins
            runner.stop()
    return worker


def _reporter(worker: MlxqWorker, config: WorkerConfig) -> Reporter:
    metrics = None
    if config.metrics_port is not None:
        from mlxq.worker.metrics import WorkerMetrics

        metrics = WorkerMetrics()
        metrics.serve(config.metrics_port)
        log.info("metrics on http://0.0.0.0:%d/metrics", metrics.port)
    return Reporter(
        worker.name,
        config.model,
        worker.queue_names(),
        config.facts,
        config.adapter_path,
        metrics,
    )
