"""Wiring a worker together: profile → engine on the MLX thread → scheduler → RQ worker."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from mlxq.broker import keys
from mlxq.engine.hardware import DeviceFacts
from mlxq.engine.mlx_lm_batch import Engine
from mlxq.engine.model_facts import model_info
from mlxq.engine.model_source import check_adapter, load_model, resolve_model
from mlxq.engine.runner import Runner
from mlxq.engine.scheduler import (
    DEFAULT_PREFILL_BATCH,
    MAX_AUTO_BATCH,
    PREFILL_TOKENS,
    Scheduler,
    auto_max_batch,
    memory_budget,
    split_budget,
)
from mlxq.errors import StartupError, one_line
from mlxq.wire import Result
from mlxq.worker.profile import WorkerProfile
from mlxq.worker.reporting import Reporter
from mlxq.worker.rq_worker import MlxqWorker

if TYPE_CHECKING:  # the metrics extra is imported only when --metrics-port asks for it
    from mlxq.worker.metrics import WorkerMetrics

log = logging.getLogger("mlxq.worker")


def worker_queues(profile: WorkerProfile) -> list[str]:
    """The profile's queues, or the model's own queue and ``default``."""
    if profile.queues:
        return list(profile.queues)
    own = keys.queue_name_for_model(profile.model)
    return [own] if own == keys.DEFAULT_QUEUE else [own, keys.DEFAULT_QUEUE]


def make_runner(profile: WorkerProfile) -> Runner:
    """A Runner whose thread loads ``profile.model`` and sizes its scheduler from memory.

    The model is found (and a hub id downloaded) and checked here, on the calling thread,
    so that a model that cannot load fails in one line before anything is served.
    """
    if not profile.model:
        raise ValueError("no model: pass --model (a local folder or a hub id) or a --profile")
    model = profile.model
    path = resolve_model(model)
    if profile.adapter_path is not None:
        check_adapter(profile.adapter_path)

    def make_engine(facts: DeviceFacts) -> Engine:
        loaded, tokenizer = load_model(model, path, profile.adapter_path)
        _, prefix_bytes = _budgets(facts, model_info(loaded, model).param_bytes, profile)
        return engine_for(loaded, tokenizer, model, profile, prefix_bytes)

    def make_scheduler(engine: Engine, facts: DeviceFacts) -> Scheduler:
        return build_scheduler(engine, facts, profile)

    return Runner(make_engine, make_scheduler)


def engine_for(
    loaded: Any, tokenizer: Any, name: str, profile: WorkerProfile, prefix_cache_bytes: int
) -> Engine:
    """A warmed-up Engine over a loaded model, sized as the profile says."""
    engine = Engine.from_loaded(
        loaded,
        tokenizer,
        name,
        max_batch=profile.max_batch or MAX_AUTO_BATCH,
        prefill_batch=profile.prefill_batch or DEFAULT_PREFILL_BATCH,
        prefill_step=profile.prefill_step,
        prefix_cache_bytes=prefix_cache_bytes,
    )
    engine.warmup()
    return engine


def build_scheduler(engine: Engine, facts: DeviceFacts, profile: WorkerProfile) -> Scheduler:
    """Size the batch and KV budget from the device's memory and the model's shape."""
    info = engine.info
    budget, prefix_bytes = _budgets(facts, info.param_bytes, profile)
    max_batch = profile.max_batch or auto_max_batch(budget, info.kv_bytes_per_token)
    log.info(
        "device: %s %s on %s (%s), %.1f GiB memory, KV budget %.1f GiB + prefix cache %.1f GiB",
        facts.backend,
        facts.name,
        facts.host,
        facts.os,
        facts.memory_bytes / 2**30,
        budget / 2**30,
        prefix_bytes / 2**30,
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
        max_batch,
    )
    return Scheduler(
        max_batch=max_batch,
        kv_bytes_per_token=info.kv_bytes_per_token,
        budget_bytes=budget,
        context_length=info.context_length,
        prefetch=profile.prefill_batch or DEFAULT_PREFILL_BATCH,
        auto_prefill=profile.prefill_batch is None,
        prefill_step=profile.prefill_step,
        prefill_tokens=PREFILL_TOKENS.get(facts.backend, PREFILL_TOKENS["cpu"]),
    )


def _budgets(facts: DeviceFacts, param_bytes: int, profile: WorkerProfile) -> tuple[int, int]:
    """(KV bytes for running jobs, bytes for the prefix cache) on this device."""
    total = memory_budget(facts.recommended_bytes, param_bytes, profile.memory_fraction)
    return split_budget(total, profile.prefix_cache_fraction)


def run_worker(
    profile: WorkerProfile,
    conn: redis.Redis,
    *,
    burst: bool = False,
    queues: list[str] | None = None,
    on_finish: Callable[[Result], None] | None = None,
    log_level: str = "INFO",
    runner: Runner | None = None,
) -> MlxqWorker:
    """Load the model, then serve ``queues`` until stopped (or empty, with ``burst``).

    ``runner`` is an already started :func:`make_runner` (``mlxq run`` loads the model
    before it submits anything); without one, the model is loaded here.
    """
    metrics = _serve_metrics(profile)
    if runner is None:
        runner = make_runner(profile)
        runner.start()
    worker = MlxqWorker(
        queues or worker_queues(profile),
        connection=conn,
        runner=runner,
        model_name=profile.model or "",
        name=profile.name,
        abandon_after=profile.abandon_after,
        grace_period=profile.grace_period,
    )
    worker.on_finish = on_finish
    worker.reporter = _reporter(worker, profile, runner, metrics)
    try:
        worker.work(burst=burst, logging_level=log_level)
    finally:
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
    worker: MlxqWorker, profile: WorkerProfile, runner: Runner, metrics: WorkerMetrics | None
) -> Reporter:
    assert runner.facts is not None
    return Reporter(
        worker.name,
        profile.model or "",
        worker.queue_names(),
        runner.facts,
        profile.adapter_path,
        metrics,
    )
