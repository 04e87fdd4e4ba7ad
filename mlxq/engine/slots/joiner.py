"""How waiting jobs join the slot engine's batch: plan, prefill and seat one group at a time.

:class:`Joiner` says when a group is due and seats it. The policy of when a group joins
and which jobs it holds is :mod:`mlxq.engine.slots.joins` (plain Python); the prefill
itself is :mod:`mlxq.engine.slots.prefill`. A job of ``n`` samples is prefilled once and
seated in ``n`` rows (:mod:`mlxq.engine.slots.n_samples`). A group whose prefill fails
leaves the decoding rows as they were; its jobs are then prefilled one by one, so that
only a job whose own prefill fails ends in error.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_logits_processors

from mlxq.engine.faults import peer_lost
from mlxq.engine.models.facts import runs_collectives
from mlxq.engine.prefix_cache import PrefixCache
from mlxq.engine.prompts import error_line
from mlxq.engine.sampling import Completion, RunningJob, make_job_sampler
from mlxq.engine.slots.batch import SlotBatch
from mlxq.engine.slots.buckets import group_rows
from mlxq.engine.slots.cache import LayoutRefused
from mlxq.engine.slots.joins import JoinPolicy, Waiting, join_due, pick_group
from mlxq.engine.slots.n_samples import Samples
from mlxq.engine.slots.prefill import PrefillRows, prefill_group
from mlxq.engine.slots.prefill_streams import PrefillStreams
from mlxq.engine.slots.softmax import SOFTMAXES
from mlxq.engine.slots.step import Row

log = logging.getLogger("mlxq.engine.slots.engine")


class Joiner:
    """Seats the batch's waiting jobs in free slots, a prefill group at a time.

    ``prefill_batch`` jobs prefill together (with ``prefill_tokens``, as many as that many
    prompt tokens hold: the prefill batch then only paces joins), in chunks of
    ``prefill_step`` tokens; ``policy`` paces small groups; ``prefix`` (if any) supplies
    and stores the KV of recurring prompt prefixes.
    """

    def __init__(
        self,
        batch: SlotBatch,
        prefix: PrefixCache | None,
        policy: JoinPolicy,
        prefill_batch: int,
        prefill_step: int,
        prefill_tokens: int | None,
    ) -> None:
        self.batch, self.prefix, self.policy = batch, prefix, policy
        self.prefill_batch = max(1, min(prefill_batch, batch.max_batch))
        self.prefill_step, self.prefill_tokens = prefill_step, prefill_tokens
        count = batch.choices.prefill_streams
        if runs_collectives(batch.model):  # (each rank's collectives in one order)
            count = 1
        self.streams = PrefillStreams(count) if count > 1 else None

    @property
    def group(self) -> int:
        """Waiting jobs worth one prefill call while others decode."""
        return max(1, min(self.prefill_batch, self.batch.max_batch // 8))

    def due(self) -> bool:
        """Whether a group should join before this step (:func:`~.joins.join_due`)."""
        b = self.batch
        args = (len(b.rows), b.cache.free_slots, self.group, b.steps, self.policy)
        return join_due(b.waiting, *args)

    def join(self) -> list[Completion]:
        """Plan, prefill and seat the next group of waiting jobs (one prefill batch); the
        jobs that could not start."""
        b = self.batch
        free = b.cache.free_slots
        limit = free if self.prefill_tokens else min(self.prefill_batch, free)
        if b.choices.prefill_buckets:
            limit = group_rows(min(limit, len(b.waiting)))
        tokens, step = self.prefill_tokens, self.prefill_step
        if tokens and self.streams is not None:  # (each stream prefills that many)
            tokens *= len(self.streams.streams)
        group = pick_group(b.waiting, limit, self.prefix, tokens, step, free)
        b.waiting_keys.difference_update(w.run.job.key for w in group)
        return self._prefill(group) if group else []

    def _prefill(self, group: list[Waiting]) -> list[Completion]:
        """Make room for the group, prefill it into its slots and seat its rows."""
        b = self.batch
        slots = [b.cache.alloc() for w in group for _ in range(w.rows)]
        plan = group[0].plan
        reused = plan.reused_tokens if plan is not None else 0
        prefix = self.prefix.kv_cache(plan) if plan is not None and self.prefix else None
        suffixes = [w.run.prompt[reused:-1] for w in group]
        self._settle_inflight()
        try:
            slots = b.room_for(slots, max(len(w.run.prompt) for w in group))
        except LayoutRefused as exc:  # (refused before any copy: the decoding jobs go on)
            return self._failed(group, slots, exc)
        except Exception as exc:  # (a cache half laid out: every decoding job fails)
            return self._drop(group, slots, exc) + b.fail(exc)
        tic = time.perf_counter()
        try:
            rows = self._run(group, slots, suffixes, prefix)
        except Exception as exc:
            b.give_back_memory()
            return self._failed(group, slots, exc)
        b.stats.prefilled_tokens += sum(len(s) for s in suffixes)
        b.stats.prefill_calls += 1
        b.stats.prefill_seconds += time.perf_counter() - tic
        self._seat_group(group, slots, rows)
        return []

    def _settle_inflight(self) -> None:
        """Let the step in flight finish first: while its attention still reads the cache,
        writing the group's rows would copy every layer instead of updating it. (Its
        time is decode time, so it is counted there.)"""
        step = self.batch.inflight
        if step is not None:
            tic = time.perf_counter()
            mx.eval(step.sampled, step.logprobs)
            self.batch.stats.decode_seconds += time.perf_counter() - tic

    def _run(
        self,
        group: list[Waiting],
        slots: list[int],
        suffixes: list[list[int]],
        prefix: list[KVCache] | None,
    ) -> PrefillRows:
        """The group's prefill call, written into ``slots``."""
        b = self.batch
        return prefill_group(
            b.model,
            b.cache,
            slots,
            suffixes,
            prefix,
            self.prefill_step,
            b.choices.prefill_buckets,
            [w.rows for w in group],
            self.streams,
            b.choices.prefill_block,
            SOFTMAXES[b.choices.softmax],
        )

    def _seat_group(self, group: list[Waiting], slots: list[int], rows: PrefillRows) -> None:
        """Store each job's recurring prefix (if it is to) and seat its rows."""
        at = 0
        for i, w in enumerate(group):
            if w.plan is not None and w.plan.store:
                store_to = w.plan.store_to
                w.plan.owner.store(w.plan, rows.row(i), w.run.prompt[:store_to], w.run.prompt)
            self._seat(w, slots[at : at + w.rows])
            at += w.rows

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
            self.batch.cache.free(slot)
        for w in group:
            w.alone = True
        self.batch.waiting[:0] = group
        self.batch.waiting_keys.update(w.run.job.key for w in group)
        return []

    def _drop(self, group: list[Waiting], slots: list[int], exc: Exception) -> list[Completion]:
        """Fail a group that could not start; its slots are free again. A collective whose
        peer rank is gone is no fault of the group: it is raised (the worker puts it back)."""
        if peer_lost(exc):
            raise exc
        for slot in slots:
            self.batch.cache.free(slot)
        out = []
        for w in group:
            if w.plan is not None:
                w.plan.release()
            error = f"could not start the job: {error_line(exc)}"
            out.append(w.run.completion("error", "", error))
        return out

    def _seat(self, w: Waiting, slots: list[int]) -> None:
        """Make the prefilled job's rows: one, or one per sample."""
        w.run.plan = w.plan
        if len(slots) == 1:
            self._add_row(w.run, slots[0])
            return
        samples = Samples(w.run)
        self.batch.samples[samples.key] = samples
        for i, slot in enumerate(slots):
            self._add_row(samples.start(i, self.batch.tokenizer), slot, samples, i)

    def _add_row(
        self, run: RunningJob, slot: int, samples: Samples | None = None, i: int = 0
    ) -> None:
        b, req = self.batch, run.job.request
        penalty = req.repetition_penalty
        processors = [] if penalty is None else make_logits_processors(repetition_penalty=penalty)
        sampler = make_job_sampler(req, b.info.vocab_size, i)
        b.rows[slot] = Row(run, slot, sampler, processors, run.prompt[-1], samples, i)
        b.keys[run.job.key] = slot
        for hook in b.hooks:
            hook.admit(run.job.key, req)
