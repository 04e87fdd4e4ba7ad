"""The slot engine: continuous batching over a preallocated slot KV cache.

Same contract as the ``BatchGenerator`` engine (:class:`~mlxq.engine.protocol.BatchEngine`;
per-job samplers, seeds, repetition penalty, stop strings, logprobs, streaming, cancel,
``max_tokens``, EOS), without its whole-cache copies: every job owns a slot of
:class:`~mlxq.engine.slot_cache.SlotCache`. A finished job frees its slot with no tensor
work. Joining jobs wait until a group of them is worth a prefill call (hysteresis: at
least ``join_group`` waiting, or nothing decoding, or waited ``JOIN_WAIT_STEPS`` steps),
are prefilled as their own batch (:mod:`mlxq.engine.slot_prefill`) and written into free
slots; each decode step then feeds every row one token at its own position.

Per-step logits processing over the whole batch: ``hooks`` is a list of
:class:`~mlxq.engine.protocol.BatchLogitsHook`. After the per-row processors
(repetition penalty) and before sampling, each hook's ``process(logits, rows)`` gets the
step's ``[rows, vocab]`` logits (one row per decoding job, in slot order; free slots are
already dropped) with ``rows`` the jobs' keys, and returns new logits (e.g. a grammar
mask filled once for all constrained rows, applied on the device). After sampling,
``accept(rows, tokens)`` gets each row's chosen token (EOS included) so a matcher can
advance. A hook hears of a job when it starts decoding (``admit(key, request)``) and
when it leaves, for any reason (``release(key)``).

With ``prefix_cache_bytes``, a job starts from the stored KV of a recurring prompt prefix
(:mod:`mlxq.engine.prefix_cache`): the prefix is written into its group's rows and only
the rest is prefilled; a job whose prefix recurs stores it from its rows after prefill.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_logits_processors

from mlxq.engine import mlx_lm_seam
from mlxq.engine.attention import choose_kernel
from mlxq.engine.hardware import backend_name
from mlxq.engine.model_facts import model_info
from mlxq.engine.prefix_cache import Plan, make_prefix_cache
from mlxq.engine.prompts import JobInputError, PromptEncoder, error_line
from mlxq.engine.protocol import BatchLogitsHook, warm_up
from mlxq.engine.sampling import (
    Completion,
    EngineJob,
    RunningJob,
    Sampler,
    StreamChunk,
    make_job_sampler,
    token_logprobs,
)
from mlxq.engine.slot_cache import DecodeState, SlotCache, SlotLayer
from mlxq.engine.slot_prefill import prefill_group
from mlxq.engine.stats import EngineStats
from mlxq.wire import FinishReason, Request

log = logging.getLogger("mlxq.engine.slot_engine")
# Joining jobs wait at most this many decode steps for their group to fill.
JOIN_WAIT_STEPS = 4
# Rows per attention group (each attends up to its own longest row).
GROUP_ROWS = 64


@dataclass
class _Row:
    """A decoding job: its slot, sampler, processors and the token it feeds next."""

    run: RunningJob
    slot: int
    sampler: Sampler
    processors: list[Any]
    next_input: int


@dataclass
class _Waiting:
    run: RunningJob
    plan: Plan | None = None
    planned: bool = False
    since_step: int = 0


class SlotEngine:
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
        prefix_cache_bytes: int = 0,
        attention: str | None = None,
        hooks: list[BatchLogitsHook] | None = None,
    ) -> None:
        """An engine over a loaded mlx-lm model and its ``TokenizerWrapper``.

        ``attention`` overrides the decode attention chosen for the backend ("gqa" or
        "fused"); ``hooks`` process each decode step's logits (module docstring).
        Raises ``ValueError`` if the model's cache cannot live in slots.
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
        self.hooks = list(hooks or [])
        self.attention, self._kernel = choose_kernel(backend_name(), attention)
        log.info("slot engine: %s decode attention, batch %d", self.attention, max_batch)
        self._eos = set(tokenizer.eos_token_ids)
        self._cache = SlotCache(self.info.num_layers, max_batch)
        self._rows: dict[int, _Row] = {}  # by slot
        self._keys: dict[str, int] = {}  # job key -> slot
        self._waiting: list[_Waiting] = []
        self._chunks: list[StreamChunk] = []
        self._prefix = make_prefix_cache(model, self.info, prefix_cache_bytes)
        self._stats = EngineStats()
        self._steps = 0

    # -- the BatchEngine interface, bookkeeping --

    @property
    def active(self) -> int:
        """Jobs admitted and not finished (decoding or waiting to join)."""
        return len(self._rows) + len(self._waiting)

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
        out = EngineStats(**vars(self._stats))
        if self._prefix is not None:
            for k, v in self._prefix.counts().items():
                setattr(out, k, v)
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
        if job.key in self._keys or any(w.run.job.key == job.key for w in self._waiting):
            raise ValueError(f"job {job.key} is already in the engine")
        now = time.time()
        try:
            tokens = self._prompts.prompt_tokens(job.request) if tokens is None else list(tokens)
            self._prompts.check_tokens(tokens, job.request.max_tokens)
        except JobInputError as exc:
            return Completion(job.key, "error", error=str(exc), admitted_at=now, finished_at=now)
        run = RunningJob.start(job, tokens, self.tokenizer, now)
        self._stats.prompt_tokens += len(tokens)
        if self._prefix is not None:
            self._prefix.observe(tokens)
        self._waiting.append(_Waiting(run, since_step=self._steps))
        return None

    def cancel(self, key: str) -> Completion | None:
        """Remove a job at once: a "cancelled" Completion, or None if unknown."""
        for w in self._waiting:
            if w.run.job.key == key:
                self._waiting.remove(w)
                if w.plan is not None:
                    w.plan.release()
                return w.run.completion("cancelled", "")
        slot = self._keys.get(key)
        return None if slot is None else self._finish(slot, "cancelled")

    def warmup(self) -> None:
        """Run one tiny generation so that the first real jobs skip compile/alloc costs."""
        warm_up(self)

    def close(self) -> None:
        """Drop all jobs and the slot cache."""
        self._rows.clear()
        self._keys.clear()
        self._waiting.clear()
        if self._prefix is not None:
            self._prefix.clear()
        self._cache = SlotCache(self.info.num_layers, self.max_batch)

    # -- running --

    def step(self) -> list[Completion]:
        """Prefill a joining group if one is due, then one decode step of every row.

        Returns the jobs that finished in this step.
        """
        done = self._join() if self._join_due() else []
        if self._rows:
            done += self._decode()
        self._steps += 1
        return done

    def _join_due(self) -> bool:
        free = self._cache.free_slots
        if not self._waiting or not free:
            return False
        if not self._rows or len(self._waiting) >= min(self.join_group, free):
            return True
        return self._steps - self._waiting[0].since_step >= JOIN_WAIT_STEPS

    def _join(self) -> list[Completion]:
        """Plan, prefill and seat the next group of waiting jobs (one prefill batch)."""
        group, key = [], None
        limit = min(self.prefill_batch, self._cache.free_slots)
        for w in self._waiting:
            if len(group) >= limit:
                break
            if self._prefix is not None and not w.planned:
                w.plan = self._prefix.plan(w.run.prompt)
                if w.plan is None:
                    continue  # its prefix is being computed by another job: wait
                w.planned = True
            leaf = w.plan.reused[-1] if w.plan is not None and w.plan.reused else None
            if group and leaf is not key:
                continue  # a different cached prefix: its own group
            group.append(w)
            key = leaf
        if not group:
            return []
        for w in group:
            self._waiting.remove(w)
        return self._prefill(group)

    def _prefill(self, group: list[_Waiting]) -> list[Completion]:
        slots = [self._cache.alloc() for _ in group]
        plan = group[0].plan
        reused = plan.reused_tokens if plan is not None else 0
        prefix = self._prefix.kv_cache(plan) if plan is not None and self._prefix else None
        suffixes = [w.run.prompt[reused:-1] for w in group]
        tic = time.perf_counter()
        try:
            rows = prefill_group(
                self.model, self._cache, slots, suffixes, prefix, self.prefill_step
            )
        except Exception as exc:
            mx.clear_cache()
            return [self._drop(w, slot, exc) for w, slot in zip(group, slots, strict=True)]
        self._stats.prefilled_tokens += sum(len(s) for s in suffixes)
        self._stats.prefill_seconds += time.perf_counter() - tic
        for i, (w, slot) in enumerate(zip(group, slots, strict=True)):
            if w.plan is not None and w.plan.store:
                store_to = w.plan.store_to
                w.plan.owner.store(w.plan, rows.row(i), w.run.prompt[:store_to], w.run.prompt)
            self._seat(w, slot)
        return []

    def _drop(self, w: _Waiting, slot: int, exc: Exception) -> Completion:
        self._cache.free(slot)
        if w.plan is not None:
            w.plan.release()
        return w.run.completion("error", "", f"could not start the job: {error_line(exc)}")

    def _seat(self, w: _Waiting, slot: int) -> None:
        req = w.run.job.request
        penalty = req.repetition_penalty
        processors = [] if penalty is None else make_logits_processors(repetition_penalty=penalty)
        sampler = make_job_sampler(req, self.info.vocab_size)
        w.run.plan = w.plan
        self._rows[slot] = _Row(w.run, slot, sampler, processors, w.run.prompt[-1])
        self._keys[w.run.job.key] = slot
        for hook in self.hooks:
            hook.admit(w.run.job.key, req)

    def _decode(self) -> list[Completion]:
        """One token for every row: forward, processors, hooks, sampling, bookkeeping."""
        tic = time.perf_counter()
        width = max(self._rows) + 1
        lengths = self._cache.lengths[:width]
        self._cache.reserve(max(lengths) + 1)
        rows = [self._rows.get(s) for s in range(width)]
        inputs = mx.array([0 if r is None else r.next_input for r in rows])[:, None]
        state = DecodeState.make(lengths, GROUP_ROWS, self._kernel)
        layers = [SlotLayer(self._cache, i, state) for i in range(self.info.num_layers)]
        try:
            logits = self.model(inputs, cache=layers)[:, -1, :]
            live = [r for r in rows if r is not None]
            if len(live) < width:
                logits = logits[mx.array([r.slot for r in live])]
            tokens, logprobs = self._sample(live, logits)
        except Exception as exc:
            return self._fail_batch(exc)
        self._stats.generated_tokens += len(live)
        self._stats.decode_seconds += time.perf_counter() - tic
        return self._advance(live, tokens, logprobs)

    def _sample(self, live: list[_Row], logits: mx.array) -> tuple[list[int], mx.array]:
        if any(r.processors for r in live):
            parts = []
            for i, r in enumerate(live):
                row = logits[i : i + 1]
                if r.processors:
                    context = mx.array(r.run.prompt + r.run.tokens)
                    for processor in r.processors:
                        row = processor(context, row)
                parts.append(row)
            logits = mx.concatenate(parts, axis=0)
        keys = [r.run.job.key for r in live]
        for hook in self.hooks:
            logits = hook.process(logits, keys)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [r.sampler for r in live]
        if all(s is samplers[0] for s in samplers):
            sampled = samplers[0](logprobs)
        else:
            sampled = mx.concatenate(
                [s(logprobs[i : i + 1]) for i, s in enumerate(samplers)], axis=0
            )
        mx.eval(sampled)
        tokens = sampled.tolist()
        for hook in self.hooks:
            hook.accept(keys, tokens)
        return tokens, logprobs

    def _advance(self, live: list[_Row], tokens: list[int], logprobs: mx.array) -> list[Completion]:
        now, done = time.time(), []
        wanted = [i for i, r in enumerate(live) if r.run.job.request.logprobs is not None]
        wanted = [i for i in wanted if tokens[i] not in self._eos]
        lp = {}
        if wanted:
            ns = [live[i].run.job.request.logprobs or 0 for i in wanted]
            picked = token_logprobs(logprobs[mx.array(wanted)], [tokens[i] for i in wanted], ns)
            lp = dict(zip(wanted, picked, strict=True))
        for i, (row, token) in enumerate(zip(live, tokens, strict=True)):
            run = row.run
            self._cache.lengths[row.slot] += 1  # the input token is now in its cache
            if run.first_token_at is None:
                run.first_token_at = now
            run.last_token_at = now
            reason: FinishReason | None = None
            if token in self._eos:
                reason = "stop"  # EOS: not part of the output
            elif run.add_token(token, lp.get(i)):
                reason = "stop"
            elif len(run.tokens) >= run.job.request.max_tokens:
                reason = "length"
            if reason is not None:
                done.append(self._finish(row.slot, reason))
            else:
                row.next_input = token
                if run.job.request.stream:
                    run.stream_update(self.tokenizer, self._chunks)
        return done

    def _finish(self, slot: int, reason: FinishReason, error: str | None = None) -> Completion:
        row = self._rows.pop(slot)
        run = row.run
        del self._keys[run.job.key]
        self._cache.free(slot)  # bookkeeping only
        for hook in self.hooks:
            hook.release(run.job.key)
        if run.plan is not None:
            run.plan.release()
        return run.finish(reason, self.tokenizer, self._chunks, error)

    def _fail_batch(self, exc: Exception) -> list[Completion]:
        """Fail the decoding jobs; keep the waiting ones; start from a fresh slot cache."""
        error = f"generation failed for the whole batch: {error_line(exc)}"
        failed = [self._finish(slot, "error", error) for slot in list(self._rows)]
        self._cache = SlotCache(self.info.num_layers, self.max_batch)
        mx.clear_cache()
        return failed
