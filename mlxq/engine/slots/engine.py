"""The slot engine: continuous batching over a preallocated slot KV cache.

Same contract as the ``BatchGenerator`` engine (:class:`~mlxq.engine.protocol.BatchEngine`;
per-job samplers, seeds, repetition penalty, stop strings, logprobs, streaming, cancel,
``max_tokens``, EOS), without its whole-cache copies: every job owns a slot of
:class:`~mlxq.engine.slots.cache.SlotCache`. A finished job frees its slot with no tensor
work.

:class:`SlotEngine` composes three parts around one
:class:`~mlxq.engine.slots.batch.SlotBatch` (the jobs, decoding or waiting, and the cache):
each :meth:`SlotEngine.step` lets the :class:`~mlxq.engine.slots.joiner.Joiner` seat a
group of waiting jobs if one is due (when: :mod:`mlxq.engine.slots.joins`; the prefill:
:mod:`mlxq.engine.slots.prefill`), lays the cache out for the rows, and lets the
:class:`~mlxq.engine.slots.decoder.Decoder` run one decode step
(:mod:`mlxq.engine.slots.step`) that feeds every row one token at its own position.

Per-step logits processing over the whole batch: ``hooks``, see
:class:`~mlxq.engine.protocol.BatchLogitsHook`.

With ``prefix_cache_bytes``, a job starts from the stored KV of a recurring prompt prefix
(:mod:`mlxq.engine.prefix_cache`): the prefix is written into its group's rows and only
the rest is prefilled; a job whose prefix recurs stores it from its rows after prefill.

A job of ``n`` samples is prefilled once and decodes in ``n`` rows, each sample with its
own seed, stop strings and finish (:mod:`mlxq.engine.slots.n_samples`); it completes when
the last sample ends, and a cancel ends them all.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import mlx.nn as nn

from mlxq.engine.constraints.slot_hook import ConstraintHook
from mlxq.engine.hardware import backend_name
from mlxq.engine.models import mlx_lm_seam
from mlxq.engine.models.facts import model_info
from mlxq.engine.models.fused_projections import fuse_projections
from mlxq.engine.prefix_cache import make_prefix_cache
from mlxq.engine.prompts import JobInputError, PromptEncoder
from mlxq.engine.protocol import BatchLogitsHook, warm_up
from mlxq.engine.sampling import Completion, EngineJob, RunningJob, StreamChunk
from mlxq.engine.slots.batch import SlotBatch
from mlxq.engine.slots.choices import DecodeChoices
from mlxq.engine.slots.decoder import Decoder
from mlxq.engine.slots.joiner import Joiner
from mlxq.engine.slots.joins import JoinPolicy, Waiting
from mlxq.engine.slots.silu import SILU_ENV, SWIGLUS, Swiglu
from mlxq.engine.slots.step import Step
from mlxq.engine.stats import EngineStats
from mlxq.wire import Request

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

log = logging.getLogger("mlxq.engine.slots.engine")

# Every this many steps, see whether sorting the rows by length pays (slot_order).
SORT_EVERY = 32


class SlotEngine:
    """Continuous batching of generation jobs over one model on slot caches."""

    @classmethod
    def from_loaded(
        cls,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        name: str,
        **options: Any,
    ) -> SlotEngine:
        """The constructor, spelled as the BatchGenerator engine's (keyword options of
        any type: the factory passes them on)."""
        return cls(model, tokenizer, name, **options)

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        name: str,
        *,
        max_batch: int = 32,
        prefill_batch: int = 8,
        prefill_step: int = 2048,
        prefill_tokens: int | None = None,
        prefix_cache_bytes: int = 0,
        attention: str | None = None,
        hooks: list[BatchLogitsHook] | None = None,
        kv_bits: int | None = None,
    ) -> None:
        """An engine over a loaded mlx-lm model and its ``TokenizerWrapper``.

        ``attention`` overrides the decode attention chosen for the backend ("gqa" or
        "fused"); ``hooks`` process each decode step's logits (module docstring);
        ``kv_bits`` (8 or 4) stores the slot cache quantized. ``prefill_tokens`` sizes
        each prefill group on the tokens it prefills (the prefill batch, set from the
        arrivals' prompts, then only paces joins). Raises ``ValueError`` if the
        model's cache cannot live in slots, or cannot be quantized as asked.
        """
        why = mlx_lm_seam.unsupported(model)
        if why is not None:
            raise ValueError(f"the slot engine cannot run {name}: {why}")
        mlx_lm_seam.install(model)
        self.model, self.tokenizer = model, tokenizer
        self.info = model_info(model, name, vocab_size=len(tokenizer))
        self._prompts = PromptEncoder(tokenizer, self.info)
        # Structured outputs (response_format) are one more batch hook.
        self._constraints = ConstraintHook.for_model(model, tokenizer)
        choices = DecodeChoices.choose(backend_name(), self.info, attention, kv_bits)
        self._swiglu = _swiglu_for(model, name, choices.silu)
        if choices.fused:  # (in place: the model's parameters read as before)
            fuse_projections(model, choices.fused)
        policy = JoinPolicy(wait=choices.join_wait, idle_budget=choices.join_cost * max_batch)
        log.info(
            "slot engine: up to %d rows, its KV cache sized to the jobs admitted; %s",
            max_batch,
            choices.describe(),
        )
        all_hooks = [*(hooks or []), self._constraints]
        self.batch = SlotBatch(model, tokenizer, self.info, choices, all_hooks, max_batch)
        self._prefix = make_prefix_cache(model, self.info, prefix_cache_bytes)
        self.joiner = Joiner(
            self.batch, self._prefix, policy, prefill_batch, prefill_step, prefill_tokens
        )
        self.decoder = Decoder(self.batch, self._constraints)

    # -- what the worker reads --

    @property
    def choices(self) -> DecodeChoices:
        """The decode settings this engine runs with."""
        return self.batch.choices

    @property
    def max_batch(self) -> int:
        """Rows the batch may hold."""
        return self.batch.max_batch

    @property
    def prefill_batch(self) -> int:
        """Prompts prefilled together (see :meth:`set_prefill_batch`)."""
        return self.joiner.prefill_batch

    @property
    def active(self) -> int:
        """Rows of the jobs admitted and not finished (decoding or waiting to join): one
        per job, or per sample of a job of several."""
        return self.batch.active

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids; raises :class:`JobInputError` if it cannot run."""
        return self._prompts.encode(request)

    def prefill_length(self, tokens: list[int]) -> int:
        """Tokens of this prompt the engine will likely prefill (less a cached prefix)."""
        return len(tokens) if self._prefix is None else self._prefix.uncached_length(tokens)

    def stats(self) -> EngineStats:
        """Counts of prompt, decode and prefix-cache work so far."""
        out = dataclasses.replace(self.batch.stats)
        out.mask_seconds = self._constraints.helper_seconds
        out.mask_wait_seconds = self._constraints.waited_seconds
        if self._prefix is not None:
            out = dataclasses.replace(out, **self._prefix.counts())
            out.prefill_seconds += self._prefix.seconds
        return out

    def take_stream(self) -> list[StreamChunk]:
        """New output of stream jobs since the last call (finished jobs' rest included in
        their last chunk, before their Completion)."""
        chunks, self.batch.chunks = self.batch.chunks, []
        return chunks

    def holds(self, key: str) -> bool:
        """Whether a job of this key is in the engine (waiting or decoding)."""
        return self.batch.holds(key)

    # -- what the worker asks --

    def set_prefill_batch(self, n: int) -> None:
        """Prefill up to ``n`` prompts together from the next step on."""
        self.joiner.prefill_batch = max(1, min(n, self.max_batch))

    def add(self, job: EngineJob, tokens: list[int] | None = None) -> Completion | None:
        """Queue a job to join the batch; an "error" Completion if it cannot run.

        Raises ``ValueError`` if a job with the same key is already in the engine.
        """
        if self.holds(job.key):
            raise ValueError(f"job {job.key} is already in the engine")
        now = time.time()
        try:
            tokens = self._checked_tokens(job.request, tokens)
        except JobInputError as exc:
            return Completion(job.key, "error", error=str(exc), admitted_at=now, finished_at=now)
        run = RunningJob.start(job, tokens, self.tokenizer, now)
        self.batch.stats.prompt_tokens += len(tokens)
        if self._prefix is not None:
            self._prefix.observe(tokens)
        self.batch.waiting.append(Waiting(run, since_step=self.batch.steps, rows=job.request.n))
        self.batch.waiting_keys.add(job.key)
        return None

    def _checked_tokens(self, request: Request, tokens: list[int] | None) -> list[int]:
        """The job's prompt tokens; raises :class:`JobInputError` if it cannot run."""
        if (n := request.n) > self.max_batch:
            raise JobInputError(
                f"n = {n} samples take {n} rows of the batch, and this worker's holds "
                f"{self.max_batch}; lower n or run the worker with --max-batch {n}"
            )
        tokens = self._prompts.prompt_tokens(request) if tokens is None else list(tokens)
        self._prompts.check_tokens(tokens, request.max_tokens)
        if (why := self._constraints.check(request)) is not None:
            raise JobInputError(why)
        return tokens

    def cancel(self, key: str) -> Completion | None:
        """Remove a job at once: a "cancelled" Completion, or None if unknown."""
        b = self.batch
        for w in b.waiting:
            if w.run.job.key == key:
                b.waiting.remove(w)
                b.waiting_keys.discard(key)
                if w.plan is not None:
                    w.plan.release()
                return w.run.completion("cancelled", "")
        samples = b.samples.get(key)
        if samples is not None:  # every sample still running ends; the last one says so
            samples.stopped = "cancelled"
            ended = [s for s, row in b.rows.items() if row.samples is samples]
            return [c for s in ended for c in b.finish(s, "cancelled")][-1]
        slot = b.keys.get(key)
        return None if slot is None else b.finish(slot, "cancelled")[0]

    def warmup(self) -> None:
        """Run one tiny generation so that the first real jobs skip compile/alloc costs."""
        warm_up(self)

    def close(self) -> None:
        """Drop all jobs and the slot cache."""
        if self._prefix is not None:
            self._prefix.clear()
        self.batch.clear()

    # -- running --

    def step(self) -> list[Completion]:
        """Prefill a joining group if one is due, then one decode step of every row.

        Returns the jobs that finished in this step.
        """
        with mlx_lm_seam.activations(self._swiglu):
            return self._step()

    def _step(self) -> list[Completion]:
        b = self.batch
        done = self._join() if self.joiner.due() else []
        if b.steps % SORT_EVERY == 0 and b.choices.sorting:
            b.sort_rows()
        try:
            b.fit_cache()
        except Exception as exc:  # (a cache half laid out: every decoding job fails)
            return done + b.fail(exc)
        if b.rows:
            done += self.decoder.step()
        elif b.inflight is not None:  # its rows all left (cancelled)
            b.inflight = None
        b.release_if_idle()
        b.steps += 1
        return done

    def _join(self) -> list[Completion]:
        """Seat the next group of waiting jobs (a method of its own: bench/host_overhead.py
        times it)."""
        return self.joiner.join()

    # -- a stage of a pipeline (mlxq.engine.distributed.pipeline) --

    def as_stage(self, samples: bool) -> None:
        """Run over a pipeline stage's model: eagerly (a stage sends in mid-forward, which
        a compiled forward cannot); unless it ``samples``, each decode step's tokens come
        from the rank that does, through :meth:`deliver`, before they are read."""
        self.decoder.relayed = not samples
        self.batch.stage = True
        self.joiner.streams = None  # (its sends keep one order: one stream)
        self.batch.choices = dataclasses.replace(self.batch.choices, compiled=False)
        self.batch.forward = None

    def in_flight(self) -> Step | None:
        """The decode step launched and not yet collected, if any."""
        return self.batch.inflight

    def deliver(self, tokens: list[int]) -> None:
        """The sampled tokens of the step in flight (a stage that does not sample)."""
        self.decoder.deliver(tokens)


def _swiglu_for(model: nn.Module, name: str, silu: str) -> Swiglu | None:
    """The swiglu the engine's steps run the model with (None: mlx-lm's); raises
    ``ValueError`` where ``MLXQ_SILU`` asks for one that this model would not call."""
    if silu == "mlx":
        return None
    if not mlx_lm_seam.uses_swiglu(model):
        if os.environ.get(SILU_ENV) is not None:
            raise ValueError(
                f"{SILU_ENV}={silu} applies to models whose MLP calls mlx-lm's swiglu; "
                f"{name}'s does not: unset {SILU_ENV}"
            )
        return None  # (a default that goes unused is not refused)
    return SWIGLUS[silu]
