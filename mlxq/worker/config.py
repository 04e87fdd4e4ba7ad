"""One resolved worker configuration: profile and flags, device facts and model facts,
resolved and validated once, then handed to the engine, the scheduler and the worker.

The defaults are written once, in :mod:`mlxq.worker.profile` (``None`` in a
``WorkerProfile`` means "decide here"); everything sized from the machine or the model is decided in
:func:`resolve` and nowhere else. (nano-vllm's ``config.py`` is the model.)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from mlxq.broker import keys
from mlxq.engine.hardware import DeviceFacts
from mlxq.engine.scheduler import (
    DEFAULT_PREFILL_BATCH,
    ENGINE_ROWS,
    PLANNED_JOB_TOKENS,
    PREFILL_TOKENS,
    BatchChoice,
    choose_batch,
    memory_budget,
    quantized_kv_bytes,
    split_budget,
)
from mlxq.errors import StartupError
from mlxq.wire import ModelInfo, WorkerInfo
from mlxq.worker.profile import STALL_TIMEOUT_S, WorkerProfile
from mlxq.worker.sharing import Share, Starting, share

log = logging.getLogger("mlxq.worker")


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
    engine_max_batch: int = ENGINE_ROWS  # the engine's own cap (--max-batch, else >= 256)
    share: Share | None = None  # what it may hold beside the live workers on its memory
    batch: BatchChoice | None = None  # how max_batch was decided
    resident_bytes: int = 0  # weights of its other models kept loaded beside this one

    @property
    def claimed_bytes(self) -> int:
        """What it holds of its machine's memory at most: weights, KV budget, prefix cache."""
        weights = self.info.param_bytes + self.resident_bytes
        return weights + self.kv_budget_bytes + self.prefix_cache_bytes


def worker_queues(profile: WorkerProfile) -> tuple[str, ...]:
    """The profile's queues, or each model's own queue and then ``default``."""
    if profile.queues:
        return tuple(profile.queues)
    own = [keys.queue_name_for_model(m) for m in profile.served()] or [keys.DEFAULT_QUEUE]
    return tuple(dict.fromkeys([*own, keys.DEFAULT_QUEUE]))


def queues_by_model(profile: WorkerProfile) -> dict[str, tuple[str, ...]]:
    """The queues each served model pulls from when loaded, in the worker's queue order: its
    own queue (``keys.queue_name_for_model``) and the shared ones (those that are no served
    model's own: ``default``, or ``--queue`` names). Two models of one queue name are refused:
    their jobs could not be told apart."""
    models = profile.served()
    own = {m: keys.queue_name_for_model(m) for m in models}
    if len(set(own.values())) < len(own):
        raise StartupError(
            f"models {models} share a queue name ({', '.join(own.values())}): a worker of "
            "several models tells their jobs apart by queue; serve those models from "
            "different workers"
        )
    mine = set(own.values())
    queues = worker_queues(profile)
    return {m: tuple(q for q in queues if q == own[m] or q not in mine) for m in models}


def resolve(
    profile: WorkerProfile,
    facts: DeviceFacts,
    info: ModelInfo,
    neighbours: Sequence[WorkerInfo] = (),
    resident_bytes: int = 0,
    starting: Sequence[Starting] = (),
) -> WorkerConfig:
    """The configuration of a worker serving ``info``'s model on ``facts``' machine, beside
    ``neighbours`` (the live workers of this host: their memory is not this one's) and the
    ``resident_bytes`` of weights of its other models that it keeps loaded (and the workers
    of this host still loading, ``starting``)."""
    if not profile.model and not info.name:
        raise ValueError("no model: pass --model (a local folder or a hub id) or a --profile")
    if profile.kv_bits is not None:  # the scheduler sizes batches on the quantized bytes
        kv = quantized_kv_bytes(info.kv_bytes_per_token, info.dtype, info.head_dim, profile.kv_bits)
        info = msgspec.structs.replace(info, kv_bytes_per_token=kv)
    room = share(facts, profile.memory_fraction, list(neighbours), tuple(starting))
    total = memory_budget(room.limit_bytes - resident_bytes, info.param_bytes, 1.0)
    if room.crowded and total < info.kv_bytes_per_token * min(
        info.context_length, PLANNED_JOB_TOKENS
    ):
        raise StartupError(_no_room(room, info))
    kv_bytes, prefix_bytes = split_budget(total, profile.prefix_cache_fraction)
    batch = choose_batch(
        kv_bytes, info.kv_bytes_per_token, facts.backend, profile.max_batch, info.context_length
    )
    log.info("%s", batch.why)
    max_batch = batch.size
    # Hold no more than max_batch jobs of the whole context can use, so workers beside it
    # get the rest of the machine.
    most = max_batch * info.context_length * info.kv_bytes_per_token
    if kv_bytes > most:
        total = int(most / (1 - profile.prefix_cache_fraction))
        kv_bytes, prefix_bytes = split_budget(total, profile.prefix_cache_fraction)
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
        engine_max_batch=profile.max_batch or max(max_batch, ENGINE_ROWS),
        share=room,
        batch=batch,
        resident_bytes=resident_bytes,
    )


def _no_room(room: Share, info: ModelInfo) -> str:
    return (
        f"not enough memory left for this worker: {room.describe()}, and this model needs "
        f"{info.param_bytes / 2**30:.2f} GiB of weights plus its KV cache; stop one of them, "
        "start them with a smaller --memory-fraction or --max-batch, or run this worker on "
        "another machine"
    )
