"""``mlxq worker --hosts A,B``: one worker whose model is split over several machines.

Without ``MLX_RANK`` in its environment the command starts one rank per host
(:mod:`mlxq.worker.distributed_ranks`) and waits for them. With it (started so, by
``mlx.launch``, or by hand), it is one rank: every rank joins the group and checks its
peers (:mod:`mlxq.engine.distributed.start`) and loads its share of the model, split by
heads or by layers as :mod:`mlxq.engine.distributed.split` chooses (``--parallel``).
Rank 0 is the RQ worker: it alone talks to Redis, sizes the batch (from the smallest
rank's memory), sends the engine settings and then every engine call (tensor parallel:
:mod:`mlxq.engine.distributed.lockstep`; pipeline parallel, one engine per micro-batch:
:mod:`mlxq.engine.distributed.pipeline`); the other ranks follow.
A lost rank fails rank 0's next collective (idle, within seconds): its MLX thread stops,
its jobs go back on their queues and it exits non-zero; a hung rank stalls rank 0, whose
``--stall-timeout`` does the same. A rank that loses rank 0 exits non-zero.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import redis

from mlxq.engine.distributed import pipeline
from mlxq.engine.distributed.channel import Channel
from mlxq.engine.distributed.lockstep import PING_S, LockstepEngine, follow
from mlxq.engine.distributed.relay import Relay
from mlxq.engine.distributed.silence import Silence
from mlxq.engine.distributed.split import load_split
from mlxq.engine.distributed.stages import stage_info
from mlxq.engine.distributed.start import Start, greet, join
from mlxq.engine.distributed.tensor import rank_info
from mlxq.engine.hardware import DeviceFacts, device_facts
from mlxq.engine.models.facts import model_info
from mlxq.engine.models.source import resolve_model
from mlxq.engine.protocol import BatchEngine
from mlxq.engine.slots.engine import SlotEngine
from mlxq.errors import StartupError, one_line
from mlxq.worker.config import resolve
from mlxq.worker.launch import Setup, engine_for, engine_sizes, run_worker
from mlxq.worker.profile import STALL_TIMEOUT_S, WorkerProfile

log = logging.getLogger("mlxq.worker.distributed")


class EngineOptions(msgspec.Struct):
    """What :func:`~mlxq.worker.launch.engine_for` reads of a configuration: rank 0's
    decisions, sent so that every rank builds the same engine."""

    model: str
    engine: str | None
    engine_max_batch: int
    prefill_batch: int
    prefill_step: int
    prefill_tokens: int
    auto_prefill: bool
    prefix_cache_bytes: int
    kv_bits: int | None


class RankZeroSetup(Setup):
    """Rank 0's :class:`Setup`: its share of the model, the batch sized from the smallest
    rank's memory, the engine settings sent to the other ranks, a lockstep engine."""

    def __init__(
        self,
        profile: WorkerProfile,
        conn: redis.Redis,
        channel: Channel,
        start: Start,
        path: Path,
    ) -> None:
        super().__init__(profile, conn)
        self.channel, self.started, self.path = channel, start, path

    def _engine(self, facts: DeviceFacts, model: str | None = None) -> BatchEngine:
        name, group, size = self.profile.model or "", self.channel.group, self.channel.size
        loaded, tokenizer, split, why = load_split(
            name, self.path, self.profile.adapter_path, group, self.profile.parallel,
            self.profile.backend,
        )  # fmt: skip
        facts = msgspec.structs.replace(facts, memory_bytes=self.started.memory_bytes)
        info = model_info(loaded, name, vocab_size=len(tokenizer))
        info = rank_info(info, size) if split == "tensor" else stage_info(info, loaded)
        self.config = resolve(self.profile, facts, info, self.neighbours)
        options = msgspec.convert(self.config, EngineOptions, from_attributes=True)
        self.channel.broadcast(msgspec.msgpack.encode(options))
        hosts = ", ".join(self.started.hosts)
        memory = self.started.memory_bytes / 2**30
        if split == "tensor":
            log.info(
                "tensor parallel over %d ranks (%s; %s): %d of %d KV heads per rank; the "
                "batch is sized from the smallest rank's memory, %.1f GiB",
                size, hosts, why, info.num_kv_heads, info.num_kv_heads * size, memory,
            )  # fmt: skip
            return LockstepEngine(engine_for(loaded, tokenizer, options), self.channel)  # type: ignore[arg-type]
        log.info(
            "pipeline parallel over %d ranks (%s; %s): up to %d of %s layers per rank, %d "
            "micro-batches in flight; the batch is sized from the smallest rank's memory, "
            "%.1f GiB",
            size, hosts, why, info.num_layers, getattr(loaded.args, "num_hidden_layers", "?"), size,
            memory,
        )  # fmt: skip
        engine = pipeline.PipelineEngine(
            micro_batches(loaded, tokenizer, options, size, True), Relay(group)
        )
        engine.warmup()
        return engine  # type: ignore[return-value]


def micro_batches(
    loaded: object, tokenizer: object, options: EngineOptions, size: int, samples: bool
) -> list[SlotEngine]:
    """A stage's engines, one per micro-batch, sharing the batch and prefix cache sizes;
    ``samples``: rank 0's, whose stage samples."""
    sizes = engine_sizes(options)  # type: ignore[arg-type]
    sizes["max_batch"] = -(-options.engine_max_batch // size)
    sizes["prefix_cache_bytes"] = options.prefix_cache_bytes // size
    engines = []
    for _ in range(size):
        engine = SlotEngine(loaded, tokenizer, options.model, **sizes)  # type: ignore[arg-type]
        engine.as_stage(samples)
        engines.append(engine)
    return engines


def serve(
    profile: WorkerProfile,
    connect: Callable[[], redis.Redis],
    *,
    burst: bool = False,
    log_level: str = "INFO",
) -> int:
    """Run ``mlxq worker --hosts``: start the ranks, or be one; the exit status."""
    if os.environ.get("MLX_RANK") is None:
        from mlxq.worker.distributed_ranks import launch

        return launch(profile)
    if len(profile.models) > 1:
        raise StartupError("--hosts serves one model: pass one --model")
    path = resolve_model(profile.model or "")
    conn = connect() if os.environ["MLX_RANK"] == "0" else None  # (only rank 0 uses Redis)
    channel = Channel(join(profile.backend))
    start = greet(channel, profile.model or "", path)
    if channel.rank != 0:
        return _follow(profile, channel, path)
    assert conn is not None
    setup = RankZeroSetup(profile, conn, channel, start, path)
    setup.start()
    run_worker(profile, conn, burst=burst, log_level=log_level, setup=setup)
    return 0


def _patience(profile: WorkerProfile) -> float:
    """How long a rank waits for rank 0's next message before it gives up on it: rank 0's
    own stall timeout (a stalled rank 0 has exited by then) and two of its idle pings."""
    backend = device_facts().backend
    stall = profile.stall_timeout or STALL_TIMEOUT_S.get(backend, STALL_TIMEOUT_S["cpu"])
    return stall + 2 * PING_S


def _silence(profile: WorkerProfile, rank: int) -> Silence:
    """The watchdog of this rank's waits for rank 0 (:func:`_patience` each)."""
    return Silence(
        _patience(profile),
        f"mlxq: error: rank {rank}: no word from rank 0 for {{s}} s (its --stall-timeout and "
        "two pings): it hung or its host is gone; this rank exits (restart the worker)",
    )


def _follow(profile: WorkerProfile, channel: Channel, path: Path) -> int:
    """A rank other than 0: load its share, build the engines rank 0 describes, follow."""
    name = profile.model or ""
    loaded, tokenizer, split, _ = load_split(
        name, path, profile.adapter_path, channel.group, profile.parallel, profile.backend
    )
    try:
        options = msgspec.msgpack.decode(channel.broadcast(), type=EngineOptions)
        log.info("rank %d of %d: following rank 0 (%s parallel)", channel.rank, channel.size, split)
        silence = _silence(profile, channel.rank)
        try:
            if split == "tensor":
                engine = engine_for(loaded, tokenizer, options)  # type: ignore[arg-type]
                steps = follow(engine, channel, silence.tick)
            else:
                engines = micro_batches(loaded, tokenizer, options, channel.size, False)
                steps = pipeline.follow(engines, Relay(channel.group), silence.tick)
        finally:
            silence.close()
    except RuntimeError as e:  # (MLX's ring: "connection to a peer was lost")
        raise StartupError(f"rank {channel.rank} lost the other ranks: {one_line(e)}") from e
    log.info("rank %d: rank 0 closed the engine after %d steps", channel.rank, steps)
    return 0
