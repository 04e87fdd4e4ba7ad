"""One resolved worker configuration: profile and flags, device facts and model facts,
resolved and validated once, then handed to the engine, the scheduler and the worker.

The defaults are written once, in :mod:`mlxq.worker.profile` (``None`` in a
``WorkerProfile`` means "decide here"); everything sized from the machine or the model is decided in
:func:`resolve` and nowhere else. (nano-vllm's ``config.py`` is the model.)
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from mlxq.broker import keys
from mlxq.engine.hardware import DeviceFacts
from mlxq.engine.scheduler import (
    DEFAULT_PREFILL_BATCH,
    MAX_AUTO_BATCH,
    PREFILL_TOKENS,
    auto_max_batch,
    memory_budget,
    quantized_kv_bytes,
    split_budget,
)
from mlxq.wire import ModelInfo
from mlxq.worker.profile import STALL_TIMEOUT_S, WorkerProfile


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker runs with, decided (no ``None`` meaning "automatic" left)."""

    model: str
    adapter_path: str | None
    queues: tuple[str, ...]
    name: str | None
    facts: DeviceFacts
    info: ModelInfo
    max_batch: int
    prefill_batch: int  # the first prefill batch; resized per arrival when automatic
    auto_prefill: bool
    prefill_step: int
    prefill_tokens: int  # prompt tokens per prefill call, when automatic
    kv_budget_bytes: int  # for running jobs' KV caches
    prefix_cache_bytes: int  # for shared prompt prefixes
    abandon_after: int
    max_job_bytes: int
    grace_period: float
    stall_timeout: float
    metrics_port: int | None
    engine: str | None = None  # the batch engine asked for (None: chosen by the model)
    kv_bits: int | None = None  # a quantized slot cache (info.kv_bytes_per_token counts it)
    engine_max_batch: int = MAX_AUTO_BATCH  # the engine's own cap (--max-batch, else 256)


def worker_queues(profile: WorkerProfile) -> tuple[str, ...]:
    """The profile's queues, or the model's own queue and ``default``."""
    if profile.queues:
        return tuple(profile.queues)
    own = keys.queue_name_for_model(profile.model)
    return (own,) if own == keys.DEFAULT_QUEUE else (own, keys.DEFAULT_QUEUE)


def resolve(profile: WorkerProfile, facts: DeviceFacts, info: ModelInfo) -> WorkerConfig:
    """The configuration of a worker serving ``info``'s model on ``facts``' machine."""
    if not profile.model and not info.name:
        raise ValueError("no model: pass --model (a local folder or a hub id) or a --profile")
    if profile.kv_bits is not None:  # the scheduler sizes batches on the quantized bytes
        kv = quantized_kv_bytes(info.kv_bytes_per_token, info.dtype, info.head_dim, profile.kv_bits)
        info = msgspec.structs.replace(info, kv_bytes_per_token=kv)
    total = memory_budget(facts.recommended_bytes, info.param_bytes, profile.memory_fraction)
    kv_bytes, prefix_bytes = split_budget(total, profile.prefix_cache_fraction)
    max_batch = profile.max_batch or auto_max_batch(kv_bytes, info.kv_bytes_per_token)
    stall = profile.stall_timeout or STALL_TIMEOUT_S.get(facts.backend, STALL_TIMEOUT_S["cpu"])
    return WorkerConfig(
        model=profile.model or info.name,
        adapter_path=profile.adapter_path,
        queues=worker_queues(profile),
        name=profile.name,
        facts=facts,
        info=info,
        max_batch=max_batch,
        prefill_batch=profile.prefill_batch or DEFAULT_PREFILL_BATCH,
        auto_prefill=profile.prefill_batch is None,
        prefill_step=profile.prefill_step,
        prefill_tokens=PREFILL_TOKENS.get(facts.backend, PREFILL_TOKENS["cpu"]),
        kv_budget_bytes=kv_bytes,
        prefix_cache_bytes=prefix_bytes,
        abandon_after=profile.abandon_after,
        max_job_bytes=profile.max_job_bytes,
        grace_period=profile.grace_period,
        stall_timeout=stall,
        metrics_port=profile.metrics_port,
        engine=profile.engine,
        kv_bits=profile.kv_bits,
        engine_max_batch=profile.max_batch or MAX_AUTO_BATCH,
    )
