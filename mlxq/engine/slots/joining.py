"""How the slot engine seats joining jobs: plan, prefill and seat one group at a time.

A mixin of :class:`~mlxq.engine.slots.engine.SlotEngine` (the engine's state is its own):
the policy of when a group joins and which jobs it holds is :mod:`mlxq.engine.slots.joins`
(plain Python); the prefill itself is :mod:`mlxq.engine.slots.prefill`. A job of ``n``
samples is prefilled once and seated in ``n`` rows (:mod:`mlxq.engine.slots.samples`).
A group whose prefill fails leaves the decoding rows as they were; its jobs are then
prefilled one by one, so that only a job whose own prefill fails ends in error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from mlxq.engine.distributed.channel import peer_lost
from mlxq.engine.prompts import error_line
from mlxq.engine.sampling import Completion, RunningJob, make_job_sampler
from mlxq.engine.slots.cache import LayoutRefused
from mlxq.engine.slots.decode import Row
from mlxq.engine.slots.joins import JoinPolicy, Waiting, join_due, pick_group
from mlxq.engine.slots.prefill import prefill_group
from mlxq.engine.slots.prefill_shapes import group_rows
from mlxq.engine.slots.samples import Samples

log = logging.getLogger("mlxq.engine.slots.engine")


class Joining:
    """Joins of waiting jobs into the running batch (the slot engine's part; the state
    below is the engine's, set in its constructor)."""

    model: Any
    tokenizer: Any
    info: Any
    choices: Any
    hooks: list[Any]
    prefill_batch: int
    prefill_step: int
    prefill_tokens: int | None
    join_policy: JoinPolicy
    _cache: Any
    _prefix: Any
    _stats: Any
    _waiting: list[Waiting]
    _waiting_keys: set[str]
    _rows: dict[int, Row]
    _keys: dict[str, int]
    _samples: dict[str, Samples]
    _inflight: Any
    _steps: int
    join_group: int  # (a property of the engine)
    _room_for: Callable[[list[int], int], list[int]]  # (the engine's)
    _fail_batch: Callable[[Exception], list[Completion]]

    def _join_due(self) -> bool:
        free = self._cache.free_slots
        args = (len(self._rows), free, self.join_group, self._steps, self.join_policy)
        return join_due(self._waiting, *args)

    def _join(self) -> list[Completion]:
        """Plan, prefill and seat the next group of waiting jobs (one prefill batch)."""
        free = self._cache.free_slots
        limit = free if self.prefill_tokens else min(self.prefill_batch, free)
        if self.choices.prefill_buckets:
            limit = group_rows(min(limit, len(self._waiting)))
        tokens, step = self.prefill_tokens, self.prefill_step
        group = pick_group(self._waiting, limit, self._prefix, tokens, step, free)
        self._waiting_keys.difference_update(w.run.job.key for w in group)
        return self._prefill(group) if group else []

    def _prefill(self, group: list[Waiting]) -> list[Completion]:
        slots = [self._cache.alloc() for w in group for _ in range(w.rows)]
        plan = group[0].plan
        reused = plan.reused_tokens if plan is not None else 0
        prefix = self._prefix.kv_cache(plan) if plan is not None and self._prefix else None
        suffixes = [w.run.prompt[reused:-1] for w in group]
        if self._inflight is not None:
            # Let the step in flight finish first: while its attention still reads the
            # cache, writing the group's rows would copy every layer instead of updating it.
            # (Its time is decode time, so it is counted there.)
            tic = time.perf_counter()
            mx.eval(self._inflight.sampled, self._inflight.logprobs)
            self._stats.decode_seconds += time.perf_counter() - tic
        try:
            slots = self._room_for(slots, max(len(w.run.prompt) for w in group))
        except LayoutRefused as exc:  # (refused before any copy: the decoding jobs go on)
            return self._failed(group, slots, exc)
        except Exception as exc:  # (a cache half laid out: every decoding job fails)
            return self._drop(group, slots, exc) + self._fail_batch(exc)
        tic = time.perf_counter()
        try:
            rows = prefill_group(
                self.model,
                self._cache,
                slots,
                suffixes,
                prefix,
                self.prefill_step,
                self.choices.prefill_buckets,
                [w.rows for w in group],
            )
        except Exception as exc:
            mx.clear_cache()
            return self._failed(group, slots, exc)
        self._stats.prefilled_tokens += sum(len(s) for s in suffixes)
        self._stats.prefill_calls += 1
        self._stats.prefill_seconds += time.perf_counter() - tic
        at = 0
        for i, w in enumerate(group):
            if w.plan is not None and w.plan.store:
                store_to = w.plan.store_to
                w.plan.owner.store(w.plan, rows.row(i), w.run.prompt[:store_to], w.run.prompt)
            self._seat(w, slots[at : at + w.rows])
            at += w.rows
        return []

    def _failed(self, group: list[Waiting], slots: list[int], exc: Exception) -> list[Completion]:
        """A group whose prefill failed (the decoding rows untouched): a job alone fails;
        the jobs of a group of several go back to the front of the line, each to be
        prefilled alone (:attr:`Waiting.alone`), so that a failure one of them causes (a
        prompt too big for memory) fails that one only, and the others start."""
        if len(group) == 1 or peer_lost(exc):
            return self._drop(group, slots, exc)
        log.warning(
            "the prefill of %d jobs together failed (%s): prefilling each alone",
            len(group),
            error_line(exc),
        )
        for slot in slots:
            self._cache.free(slot)
        for w in group:
            w.alone = True
        self._waiting[:0] = group
        self._waiting_keys.update(w.run.job.key for w in group)
        return []

    def _drop(self, group: list[Waiting], slots: list[int], exc: Exception) -> list[Completion]:
        """Fail a group that could not start; its slots are free again. A collective whose
        peer rank is gone is no fault of the group: it is raised (the worker puts it back)."""
        if peer_lost(exc):
            raise exc
        for slot in slots:
            self._cache.free(slot)
        out = []
        for w in group:
            if w.plan is not None:
                w.plan.release()
            error = f"could not start the job: {error_line(exc)}"
            out.append(w.run.completion("error", "", error))
        return out

    def _seat(self, w: Waiting, slots: list[int]) -> None:
        """Make the prefilled job rows: one, or one per sample (:mod:`slot_samples`)."""
        w.run.plan = w.plan
        if len(slots) == 1:
            self._add_row(w.run, slots[0])
            return
        samples = Samples(w.run)
        self._samples[samples.key] = samples
        for i, slot in enumerate(slots):
            self._add_row(samples.start(i, self.tokenizer), slot, samples, i)

    def _add_row(
        self, run: RunningJob, slot: int, samples: Samples | None = None, i: int = 0
    ) -> None:
        req = run.job.request
        penalty = req.repetition_penalty
        processors = [] if penalty is None else make_logits_processors(repetition_penalty=penalty)
        sampler = make_job_sampler(req, self.info.vocab_size, i)
        self._rows[slot] = Row(run, slot, sampler, processors, run.prompt[-1], samples, i)
        self._keys[run.job.key] = slot
        for hook in self.hooks:
            hook.admit(run.job.key, req)
