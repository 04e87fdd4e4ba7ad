"""The slot engine's shared state: the rows decoding, the jobs waiting, the slot cache.

Every part of :class:`~mlxq.engine.slots.engine.SlotEngine` works on one
:class:`SlotBatch`: the engine adds and cancels jobs, the
:class:`~mlxq.engine.slots.joiner.Joiner` seats waiting jobs in free slots and the
:class:`~mlxq.engine.slots.decoder.Decoder` steps the rows. It holds what they share and
the operations more than one of them needs: ending a row (:meth:`SlotBatch.finish`),
failing every decoding row (:meth:`SlotBatch.fail`) and laying the cache out for the rows.

The cache follows the work: it holds rows for the jobs admitted (grown as they join,
twice as many at a time, never past the jobs admitted), as many positions as its live
rows need, shrinks when half its rows are unused and is dropped when no row is live
(:meth:`SlotBatch.fit_cache`, :meth:`SlotBatch.room_for`), so a lone long job costs what
it costs in mlx-lm; the scheduler admits jobs against the same shape
(:mod:`mlxq.engine.scheduler`). Rows move into length order when that cuts attention
reads enough (:meth:`SlotBatch.sort_rows`); every move goes through
:meth:`SlotBatch.moved`, so the bookkeeping follows the rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from mlxq.engine.faults import peer_lost
from mlxq.engine.prompts import error_line
from mlxq.engine.protocol import BatchLogitsHook
from mlxq.engine.sampling import Completion, StreamChunk
from mlxq.engine.scheduler import cache_rows, grown_rows
from mlxq.engine.slots import step as slot_step
from mlxq.engine.slots.cache import SlotCache
from mlxq.engine.slots.choices import DecodeChoices
from mlxq.engine.slots.compiled import CompiledForward
from mlxq.engine.slots.joins import Waiting
from mlxq.engine.slots.n_samples import Samples
from mlxq.engine.slots.order import sorted_order
from mlxq.engine.slots.rows import RowTable
from mlxq.engine.slots.step import Step
from mlxq.engine.stats import EngineStats
from mlxq.wire import FinishReason, ModelInfo

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


class SlotBatch:
    """The jobs of one slot engine, decoding or waiting, and the cache they decode in."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        info: ModelInfo,
        choices: DecodeChoices,
        hooks: list[BatchLogitsHook],
        max_batch: int,
    ) -> None:
        self.model, self.tokenizer, self.info = model, tokenizer, info
        self.choices = choices  # (the decoder may turn its compiled forward off)
        self.hooks = hooks
        self.max_batch = max_batch
        self.eos = set(tokenizer.eos_token_ids)
        self.rows = RowTable()  # by slot
        self.keys: dict[str, int] = {}  # job key (a sample's key) -> slot
        self.samples: dict[str, Samples] = {}  # jobs of several samples, decoding
        self.waiting: list[Waiting] = []
        self.waiting_keys: set[str] = set()  # (their keys: a duplicate check in O(1))
        self.chunks: list[StreamChunk] = []  # stream jobs' new output, until taken
        self.stats = EngineStats()
        self.steps = 0  # decode steps so far (joins and sorts are paced by it)
        self.stage = False  # a pipeline stage's (see give_back_memory)
        self.inflight: Step | None = None  # the decode step launched, not yet collected
        self.cache: SlotCache
        self.forward: CompiledForward | None  # the compiled forward over the cache, if any
        self.new_cache()

    @property
    def active(self) -> int:
        """Rows of the jobs admitted and not finished (decoding or waiting to join): one
        per job, or per sample of a job of several."""
        return len(self.rows) + sum(w.rows for w in self.waiting)

    def holds(self, key: str) -> bool:
        """Whether a job of this key is in the batch (waiting or decoding)."""
        return key in self.keys or key in self.waiting_keys or key in self.samples

    def new_cache(self) -> None:
        """An empty slot cache (and the compiled forward over it, if the choices say so)."""
        self.cache = SlotCache(
            self.info.num_layers,
            self.max_batch,
            bits=self.choices.kv_bits,
            group_size=self.choices.kv_group,
            on_copy=self._copied,
        )
        self.forward = (
            CompiledForward(self.model, self.cache, self.choices.kernel, self._traced)
            if self.choices.compiled
            else None
        )

    def _copied(self, seconds: float) -> None:
        self.stats.cache_copies += 1
        self.stats.cache_copy_seconds += seconds

    def _traced(self) -> None:
        self.stats.forward_traces += 1

    def clear(self) -> None:
        """Drop every job and the cache."""
        self.rows.clear()
        self.keys.clear()
        self.samples.clear()
        self.waiting.clear()
        self.waiting_keys.clear()
        self.inflight = None
        self.new_cache()

    # -- rows ending --

    def finish(self, slot: int, reason: FinishReason, error: str | None = None) -> list[Completion]:
        """End the row in ``slot``: its job's Completion, or none while other samples of
        its job still run (:mod:`~mlxq.engine.slots.n_samples`)."""
        row = self.rows.pop(slot)
        run = row.run
        del self.keys[run.job.key]
        self.cache.free(slot)  # bookkeeping only
        for hook in self.hooks:
            hook.release(run.job.key)
        if run.plan is not None:
            run.plan.release()
        done = run.finish(reason, self.tokenizer, self.chunks, error)
        if row.samples is None:
            return [done]
        whole = row.samples.finished(row.index, done)
        if whole is None:
            return []
        del self.samples[row.samples.key]
        return [whole]

    def fail(self, exc: Exception) -> list[Completion]:
        """Fail the decoding jobs; keep the waiting ones; start from a fresh slot cache. A
        collective whose peer rank is gone is no fault of the jobs: it is raised (the worker
        puts them back)."""
        if peer_lost(exc):
            raise exc
        error = f"generation failed for the whole batch: {error_line(exc)}"
        failed = [c for slot in list(self.rows) for c in self.finish(slot, "error", error)]
        self.inflight = None
        self.new_cache()
        self.give_back_memory()
        return failed

    # -- the cache laid out for the rows --

    def sort_rows(self) -> None:
        """Move the rows into length order when that cuts attention reads enough
        (:func:`~mlxq.engine.slots.order.sorted_order`)."""
        lengths = {slot: self.cache.lengths[slot] for slot in self.rows}
        order = sorted_order(lengths, slot_step.GROUP_ROWS, self.choices.saving)
        if order is None:
            return
        self.cache.permute(order)
        self.moved(order)
        self.stats.sorts += 1

    def moved(self, order: list[int]) -> None:
        """Bookkeeping after the cache moved slot ``order[i]`` to slot ``i``."""
        self.rows = RowTable(slot_step.move_rows(self.rows, order))
        for slot, row in self.rows.items():
            self.keys[row.run.job.key] = slot

    def fit_cache(self) -> None:
        """Before a decode step, keep the cache to the work: room for the step (a whole
        step more), half its rows unused shrunk away (the engine drops it when no row is
        live). A resize packs the live rows at the front (one copy, as growing is)."""
        cache = self.cache
        if not self.rows:
            return
        need = max(map(cache.lengths.__getitem__, self.rows)) + 1
        admitted = self.active
        if need <= cache.capacity and 2 * admitted >= cache.rows:
            return
        order = sorted(self.rows)  # (admitted counts them: their rows fit)
        cache.resize(min(cache.rows, cache_rows(admitted)), cache.positions(need), order)
        self.moved(order)

    def room_for(self, slots: list[int], tokens: int) -> list[int]:
        """Room for a joining group in ``slots`` (taken, not yet rows) with prompts of up
        to ``tokens``; where the cache lacks rows or positions it is laid out anew (the
        live rows, then the group's, packed at the front). The group's slots after."""
        cache, live = self.cache, sorted(self.rows)
        if max(slots) < cache.rows and tokens <= cache.capacity:
            return slots
        needed, admitted = len(live) + len(slots), self.active + len(slots)
        if needed > cache.rows:
            rows = grown_rows(needed, cache.rows, admitted, self.max_batch)
        else:  # (longer prompts: the copy also drops rows no longer admitted)
            rows = min(cache.rows, cache_rows(admitted))
        need = max([tokens, *(cache.lengths[s] + 1 for s in live)])
        cache.resize(rows, cache.positions(need), live + slots)
        self.moved(live)
        return list(range(len(live), needed))

    def release_if_idle(self) -> None:
        """Hold no cache while no row is live."""
        if not self.rows and self.cache.rows:
            self.cache.release()
            self.give_back_memory()

    def give_back_memory(self) -> None:
        """Give MLX's freed buffers back (it keeps them for reuse), except on a pipeline
        stage: ``mx.clear_cache`` waits for every stream holding Python's GIL, and a
        stage's relay stream can hold a send to a rank that is gone, which never ends:
        the whole process would hang, its stall watchdog with it."""
        if not self.stage:
            mx.clear_cache()
