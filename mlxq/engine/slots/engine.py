"""The slot engine: continuous batching over a preallocated slot KV cache.

Same contract as the ``BatchGenerator`` engine (:class:`~mlxq.engine.protocol.BatchEngine`;
per-job samplers, seeds, repetition penalty, stop strings, logprobs, streaming, cancel,
``max_tokens``, EOS), without its whole-cache copies: every job owns a slot of
:class:`~mlxq.engine.slots.cache.SlotCache`. A finished job frees its slot with no tensor
work. Joining jobs wait until a group of them is worth a prefill call
(:mod:`mlxq.engine.slots.joins`, seated by :mod:`mlxq.engine.slots.joining`), are prefilled
as their own batch (:mod:`mlxq.engine.slots.prefill`) and written into free slots; each decode step
(:mod:`mlxq.engine.slots.decode`, run by :mod:`mlxq.engine.slots.stepping`) then feeds every
row one token at its own position.

Per-step logits processing over the whole batch: ``hooks``, see
:class:`~mlxq.engine.protocol.BatchLogitsHook`.

The cache follows the work: it holds rows for the jobs admitted (grown as they join,
twice as many at a time, never past the jobs admitted), as many positions as its live
rows need, shrinks when half its rows are unused and is dropped when no row is live, so
a lone long job costs what it costs in mlx-lm; the scheduler admits jobs against the
same shape (:mod:`mlxq.engine.scheduler`).

With ``prefix_cache_bytes``, a job starts from the stored KV of a recurring prompt prefix
(:mod:`mlxq.engine.slots.prefix_cache`): the prefix is written into its group's rows and only
the rest is prefilled; a job whose prefix recurs stores it from its rows after prefill.

A job of ``n`` samples is prefilled once and decodes in ``n`` rows, each sample with its
own seed, stop strings and finish (:mod:`mlxq.engine.slots.samples`); it completes when
the last sample ends, and a cancel ends them all.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxq.engine.constraints.slot_hook import ConstraintHook
from mlxq.engine.distributed.channel import peer_lost
from mlxq.engine.hardware import backend_name
from mlxq.engine.models import mlx_lm_seam
from mlxq.engine.models.facts import model_info
from mlxq.engine.models.fused_projections import fuse_projections
from mlxq.engine.prompts import JobInputError, PromptEncoder, error_line
from mlxq.engine.protocol import BatchLogitsHook, warm_up
from mlxq.engine.sampling import (
    Completion,
    EngineJob,
    RunningJob,
    StreamChunk,
)
from mlxq.engine.scheduler import cache_rows, grown_rows
from mlxq.engine.slots import decode as slot_decode
from mlxq.engine.slots.cache import SlotCache
from mlxq.engine.slots.choices import DecodeChoices
from mlxq.engine.slots.decode import CompiledForward, Step
from mlxq.engine.slots.joining import Joining
from mlxq.engine.slots.joins import JoinPolicy, Waiting
from mlxq.engine.slots.order import sorted_order
from mlxq.engine.slots.prefix_cache import make_prefix_cache
from mlxq.engine.slots.rows import RowTable
from mlxq.engine.slots.samples import Samples
from mlxq.engine.slots.stepping import Stepping
from mlxq.engine.stats import EngineStats
from mlxq.wire import Request

log = logging.getLogger("mlxq.engine.slots.engine")

# Every this many steps, see whether sorting the rows by length pays (slot_order).
SORT_EVERY = 32


class SlotEngine(Stepping, Joining):
    """Continuous batching of generation jobs over one model on slot caches."""

    @classmethod
    def from_loaded(cls, model: nn.Module, tokenizer: Any, name: str, **options: Any) -> SlotEngine:
        """The constructor, spelled as the BatchGenerator engine's."""
        return cls(model, tokenizer, name, **options)

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
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
        self.max_batch, self.prefill_step = max_batch, prefill_step
        self.prefill_batch = max(1, min(prefill_batch, max_batch))
        self.prefill_tokens = prefill_tokens
        # Structured outputs (response_format) are one more batch hook.
        self._constraints = ConstraintHook.for_model(model, tokenizer)
        self.hooks = [*(hooks or []), self._constraints]
        self.choices = DecodeChoices.choose(backend_name(), self.info, attention, kv_bits)
        if self.choices.fused:  # (in place: the model's parameters read as before)
            fuse_projections(model, self.choices.fused)
        self.join_policy = JoinPolicy(
            wait=self.choices.join_wait, idle_budget=self.choices.join_cost * max_batch
        )
        log.info(
            "slot engine: up to %d rows, its KV cache sized to the jobs admitted; %s",
            max_batch,
            self.choices.describe(),
        )
        self._eos = set(tokenizer.eos_token_ids)
        self._new_cache()
        self._rows = RowTable()  # by slot
        self._keys: dict[str, int] = {}  # job key (a sample's key) -> slot
        self._samples: dict[str, Samples] = {}  # jobs of several samples, decoding
        self._waiting: list[Waiting] = []
        self._waiting_keys: set[str] = set()  # (their keys: a duplicate check in O(1))
        self._chunks: list[StreamChunk] = []
        self._prefix = make_prefix_cache(model, self.info, prefix_cache_bytes)
        self._stats = EngineStats()
        self._steps = 0
        self._inflight: Step | None = None  # the decode step launched, not yet collected
        self.relayed = False  # a pipeline stage that does not sample (:meth:`as_stage`)

    # -- the BatchEngine interface, bookkeeping --

    @property
    def active(self) -> int:
        """Rows of the jobs admitted and not finished (decoding or waiting to join): one
        per job, or per sample of a job of several."""
        return len(self._rows) + sum(w.rows for w in self._waiting)

    @property
    def join_group(self) -> int:
        """Waiting jobs worth one prefill call while others decode."""
        return max(1, min(self.prefill_batch, self.max_batch // 8))

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids; raises :class:`JobInputError` if it cannot run."""
        return self._prompts.encode(request)

    def prefill_length(self, tokens: list[int]) -> int:
        """Tokens of this prompt the engine will likely prefill (less a cached prefix)."""
        return len(tokens) if self._prefix is None else self._prefix.uncached_length(tokens)

    def set_prefill_batch(self, n: int) -> None:
        """Prefill up to ``n`` prompts together from the next step on."""
        self.prefill_batch = max(1, min(n, self.max_batch))

    def stats(self) -> EngineStats:
        """Counts of prompt, decode and prefix-cache work so far."""
        out = dataclasses.replace(self._stats)
        out.mask_seconds = self._constraints.helper_seconds
        out.mask_wait_seconds = self._constraints.waited_seconds
        if self._prefix is not None:
            out = dataclasses.replace(out, **self._prefix.counts())
            out.prefill_seconds += self._prefix.seconds
        return out

    def take_stream(self) -> list[StreamChunk]:
        """New output of stream jobs since the last call (finished jobs' rest included in
        their last chunk, before their Completion)."""
        chunks, self._chunks = self._chunks, []
        return chunks

    def add(self, job: EngineJob, tokens: list[int] | None = None) -> Completion | None:
        """Queue a job to join the batch; an "error" Completion if it cannot run.

        Raises ``ValueError`` if a job with the same key is already in the engine.
        """
        if self.holds(job.key):
            raise ValueError(f"job {job.key} is already in the engine")
        now = time.time()
        try:
            if (n := job.request.n) > self.max_batch:
                raise JobInputError(
                    f"n = {n} samples take {n} rows of the batch, and this worker's holds "
                    f"{self.max_batch}; lower n or run the worker with --max-batch {n}"
                )
            tokens = self._prompts.prompt_tokens(job.request) if tokens is None else list(tokens)
            self._prompts.check_tokens(tokens, job.request.max_tokens)
            if (why := self._constraints.check(job.request)) is not None:
                raise JobInputError(why)
        except JobInputError as exc:
            return Completion(job.key, "error", error=str(exc), admitted_at=now, finished_at=now)
        run = RunningJob.start(job, tokens, self.tokenizer, now)
        self._stats.prompt_tokens += len(tokens)
        if self._prefix is not None:
            self._prefix.observe(tokens)
        self._waiting.append(Waiting(run, since_step=self._steps, rows=job.request.n))
        self._waiting_keys.add(job.key)
        return None

    def holds(self, key: str) -> bool:
        """Whether a job of this key is in the engine (waiting or decoding)."""
        return key in self._keys or key in self._waiting_keys or key in self._samples

    def cancel(self, key: str) -> Completion | None:
        """Remove a job at once: a "cancelled" Completion, or None if unknown."""
        for w in self._waiting:
            if w.run.job.key == key:
                self._waiting.remove(w)
                self._waiting_keys.discard(key)
                if w.plan is not None:
                    w.plan.release()
                return w.run.completion("cancelled", "")
        samples = self._samples.get(key)
        if samples is not None:  # every sample still running ends; the last one says so
            samples.stopped = "cancelled"
            ended = [s for s, row in self._rows.items() if row.samples is samples]
            return [c for s in ended for c in self._finish(s, "cancelled")][-1]
        slot = self._keys.get(key)
        return None if slot is None else self._finish(slot, "cancelled")[0]

    def warmup(self) -> None:
        """Run one tiny generation so that the first real jobs skip compile/alloc costs."""
        warm_up(self)

    # -- a stage of a pipeline (mlxq.engine.distributed.pipeline) --

    def as_stage(self, samples: bool) -> None:
        """Run over a pipeline stage's model: eagerly (a stage sends in mid-forward, which
        a compiled forward cannot); unless it ``samples``, each decode step's tokens come
        from the rank that does, through :meth:`deliver`, before they are read."""
        self.relayed = not samples
        self.choices = dataclasses.replace(self.choices, compiled=False)
        self._forward = None

    def in_flight(self) -> Step | None:
        """The decode step launched and not yet collected, if any."""
        return self._inflight

    def deliver(self, tokens: list[int]) -> None:
        """The sampled tokens of the step in flight (a stage that does not sample)."""
        step = self._inflight
        if step is None or step.sampled is not None or len(step.rows) != len(tokens):
            rows = "none" if step is None else len(step.rows)
            raise RuntimeError(
                f"pipeline out of step: {len(tokens)} tokens for a step of {rows} rows"
            )
        step.sampled = mx.array(tokens, dtype=mx.uint32)

    def close(self) -> None:
        """Drop all jobs and the slot cache."""
        self._rows.clear()
        self._keys.clear()
        self._samples.clear()
        self._waiting.clear()
        self._waiting_keys.clear()
        self._inflight = None
        if self._prefix is not None:
            self._prefix.clear()
        self._new_cache()

    def _new_cache(self) -> None:
        self._cache = SlotCache(
            self.info.num_layers,
            self.max_batch,
            bits=self.choices.kv_bits,
            group_size=self.choices.kv_group,
        )
        self._forward = (
            CompiledForward(self.model, self._cache, self.choices.kernel)
            if self.choices.compiled
            else None
        )

    # -- running --

    def step(self) -> list[Completion]:
        """Prefill a joining group if one is due, then one decode step of every row.

        Returns the jobs that finished in this step.
        """
        done = self._join() if self._join_due() else []
        if self._steps % SORT_EVERY == 0 and self.choices.sorting:
            self._sort_rows()
        try:
            self._fit_cache()
        except Exception as exc:  # (a cache half laid out: every decoding job fails)
            return done + self._fail_batch(exc)
        if self._rows:
            done += self._decode()
        elif self._inflight is not None:  # its rows all left (cancelled)
            self._inflight = None
        if not self._rows and self._cache.rows:  # idle: hold no cache
            self._cache.release()
            mx.clear_cache()  # (MLX keeps freed buffers for reuse: give them back)
        self._steps += 1
        return done

    def _sort_rows(self) -> None:
        """Move the rows into length order when that cuts attention reads enough
        (:func:`~mlxq.engine.slots.order.sorted_order`); bookkeeping follows the rows."""
        lengths = {slot: self._cache.lengths[slot] for slot in self._rows}
        order = sorted_order(lengths, slot_decode.GROUP_ROWS, self.choices.saving)
        if order is None:
            return
        self._cache.permute(order)
        self._moved(order)
        self._stats.sorts += 1

    def _moved(self, order: list[int]) -> None:
        """Bookkeeping after the cache moved slot ``order[i]`` to slot ``i``."""
        self._rows = RowTable(slot_decode.move_rows(self._rows, order))
        for slot, row in self._rows.items():
            self._keys[row.run.job.key] = slot

    def _fit_cache(self) -> None:
        """Before a decode step, keep the cache to the work: room for the step (a whole
        step more), half its rows unused shrunk away (:meth:`step` drops it when no row
        is live). A resize packs the live rows at the front (one copy, as growing is)."""
        cache = self._cache
        if not self._rows:
            return
        need = max(map(cache.lengths.__getitem__, self._rows)) + 1
        admitted = self.active
        if need <= cache.capacity and 2 * admitted >= cache.rows:
            return
        order = sorted(self._rows)  # (admitted counts them: their rows fit)
        cache.resize(min(cache.rows, cache_rows(admitted)), cache.positions(need), order)
        self._moved(order)

    def _room_for(self, slots: list[int], tokens: int) -> list[int]:
        """Room for a joining group in ``slots`` (taken, not yet rows) with prompts of up
        to ``tokens``; where the cache lacks rows or positions it is laid out anew (the
        live rows, then the group's, packed at the front). The group's slots after."""
        cache, live = self._cache, sorted(self._rows)
        if max(slots) < cache.rows and tokens <= cache.capacity:
            return slots
        needed, admitted = len(live) + len(slots), self.active + len(slots)
        if needed > cache.rows:
            rows = grown_rows(needed, cache.rows, admitted, self.max_batch)
        else:  # (longer prompts: the copy also drops rows no longer admitted)
            rows = min(cache.rows, cache_rows(admitted))
        need = max([tokens, *(cache.lengths[s] + 1 for s in live)])
        cache.resize(rows, cache.positions(need), live + slots)
        self._moved(live)
        return list(range(len(live), needed))

    def _fail_batch(self, exc: Exception) -> list[Completion]:
        """Fail the decoding jobs; keep the waiting ones; start from a fresh slot cache. A
        collective whose peer rank is gone is no fault of the jobs: it is raised (the worker
        puts them back)."""
        if peer_lost(exc):
            raise exc
        error = f"generation failed for the whole batch: {error_line(exc)}"
        failed = [c for slot in list(self._rows) for c in self._finish(slot, "error", error)]
        self._inflight = None
        self._new_cache()
        mx.clear_cache()
        return failed
