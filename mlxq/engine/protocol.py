"""The engine interface the MLX thread drives: what every engine provides.

The :class:`~mlxq.engine.runner.Runner` and the worker use an engine only through
:class:`BatchEngine`. Three implementations satisfy it: the slot engine
(:mod:`mlxq.engine.slots.engine`, the default), the ``BatchGenerator`` engine
(:mod:`mlxq.engine.mlx_lm_batch`, the fallback for caches the slot engine cannot hold)
and the model-free stub of ``bench/queue_overhead.py``. ``tests/engine/test_slot_engine.py``
checks all three against it.

Threading: ``encode`` and ``info`` are pure (any thread); everything else is called from
the one thread that owns MLX.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import mlx.core as mx

from mlxq.engine.prompts import WARMUP_KEY
from mlxq.engine.sampling import Completion, EngineJob, StreamChunk
from mlxq.engine.stats import EngineStats
from mlxq.wire import ModelInfo, Request


@runtime_checkable
class BatchEngine(Protocol):
    """Continuous batching of generation jobs over one model."""

    info: ModelInfo
    prefill_batch: int

    @property
    def active(self) -> int:
        """Jobs admitted and not finished."""
        ...

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids; raises ``JobInputError`` if it cannot run."""
        ...

    def prefill_length(self, tokens: list[int]) -> int:
        """Tokens of this prompt the engine will likely prefill (less a cached prefix)."""
        ...

    def set_prefill_batch(self, n: int) -> None:
        """Prefill up to ``n`` prompts together from the next step on."""
        ...

    def add(self, job: EngineJob, tokens: list[int] | None = None) -> Completion | None:
        """Admit a job; an "error" Completion if it cannot run."""
        ...

    def step(self) -> list[Completion]:
        """One step of work (a prefill chunk and/or a decode step); the jobs that finished."""
        ...

    def take_stream(self) -> list[StreamChunk]:
        """New output of stream jobs since the last call."""
        ...

    def cancel(self, key: str) -> Completion | None:
        """Remove a job at once: a "cancelled" Completion, or None if unknown."""
        ...

    def stats(self) -> EngineStats:
        """Counts of prompt, decode and prefix-cache work so far."""
        ...

    def warmup(self) -> None:
        """Run a tiny generation so the first real jobs skip compile and allocation costs."""
        ...

    def close(self) -> None:
        """Drop all jobs and release device memory held for them."""
        ...


class BatchLogitsHook(Protocol):
    """Logits processing over the whole batch, once per decode step (slot engine only).

    After the per-row processors (repetition penalty) and before sampling, ``process``
    gets the step's ``[rows, vocab]`` logits (one row per decoding job, in slot order;
    free slots already dropped) with ``rows`` the jobs' keys, and returns new logits (e.g.
    a grammar mask filled once for all constrained rows, applied on the device). After
    sampling, ``accept`` gets each row's chosen token (EOS included) so a matcher can
    advance. A hook hears of a job when it starts decoding (``admit``) and when it leaves,
    for any reason (``release``).
    """

    def admit(self, key: str, request: Request) -> None:
        """A job starts decoding."""
        ...

    def process(self, logits: mx.array, rows: list[str]) -> mx.array:
        """New ``[rows, vocab]`` logits for the decoding jobs ``rows`` (keys), before sampling."""
        ...

    def accept(self, rows: list[str], tokens: list[int]) -> None:
        """The tokens sampled for ``rows`` (EOS included)."""
        ...

    def release(self, key: str) -> None:
        """A job left the batch (finished, cancelled or failed)."""
        ...


def warm_up(engine: BatchEngine) -> None:
    """Run one tiny generation through an idle engine (compiles kernels, allocates)."""
    if engine.active:
        return
    failed = engine.add(EngineJob(WARMUP_KEY, Request(prompt="Hello, world", max_tokens=4)))
    if failed is not None:
        raise RuntimeError(f"warmup failed: {failed.error}")
    while engine.active:
        engine.step()
