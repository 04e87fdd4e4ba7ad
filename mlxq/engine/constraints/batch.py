"""Structured outputs in the batch: llguidance matchers, masks filled together, applied by MLX.

:class:`Grammars` compiles each distinct constraint once for the engine's tokenizer (cached
by content) and hands out a fresh :class:`JobConstraint` per job. :class:`ConstraintBatch`
holds a batch's constrained rows: once per decode step it advances their matchers by the
tokens just sampled (``accept``) and fills all their masks in one ``LLExecutor`` call, in
parallel threads off the GIL (``masks``); :mod:`~mlxq.engine.constraints.device_masks` then applies
them to the logits on the device. Rows without a constraint are never touched. The slot
engine drives it through :mod:`~mlxq.engine.constraints.slot_hook` (a helper thread).

A matcher that fails (its grammar hit a resource limit, or a token it cannot take) is
recorded in ``ConstraintBatch.failures`` for the engine to fail that job alone; its row
gets an EOS-only mask meanwhile.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from mlxq.engine.constraints.device_masks import DeviceMasks
from mlxq.engine.constraints.grammar import ConstraintError, constraint_key, grammar_of
from mlxq.engine.constraints.mask_table import distinct_rows
from mlxq.wire import ResponseFormat

_CACHE_SIZE = 256


def logits_width(model: Any, tokenizer: Any) -> int:
    """How many logits the model outputs per token (at least the tokenizer's vocabulary):
    the width masks are made for."""
    args = getattr(model, "args", None)
    return max(len(tokenizer), getattr(args, "vocab_size", 0) or 0)


def make_lltokenizer(tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """An llguidance tokenizer for an mlx-lm ``TokenizerWrapper``, its masks ``vocab_size``
    wide (the model's logits), with the wrapper's EOS tokens."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(tokenizer.eos_token_ids)
    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)


@dataclass
class JobConstraint:
    """One job's matcher, and whether it has had its first mask (so has tokens to take)."""

    matcher: llguidance.LLMatcher
    started: bool = False

    def error(self) -> str | None:
        """Why the matcher failed, or None."""
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "the matcher is in an error state"

    def reset(self) -> None:
        """Back to the start of the grammar (a job that starts over)."""
        self.matcher.reset()
        self.started = False


@dataclass
class Prepared:
    """Masks filled ahead of a step (:meth:`ConstraintBatch.prepare`): the distinct masks,
    and each slot's row among them."""

    rows: dict[Hashable, int]
    masks: np.ndarray


class Grammars:
    """Constraints compiled for one tokenizer, cached by content (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltok: llguidance.LLTokenizer | None = None  # built on first use (~1 s)
        self._cache: collections.OrderedDict[Hashable, llguidance.LLMatcher | str] = (
            collections.OrderedDict()
        )

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._lltok is None:
            self._lltok = make_lltokenizer(self._tokenizer, self.vocab_size)
        return self._lltok

    def job(self, fmt: ResponseFormat | None) -> JobConstraint | None:
        """A fresh constraint for a job (None for free text); raises ``ConstraintError``."""
        key = constraint_key(fmt)
        if key is None:
            return None
        template = self._cache.get(key)
        if template is None:
            template = self._compile(fmt)
            self._cache[key] = template
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        if isinstance(template, str):
            raise ConstraintError(template)
        return JobConstraint(template.deep_copy())

    def _compile(self, fmt: ResponseFormat | None) -> llguidance.LLMatcher | str:
        try:
            grammar = grammar_of(fmt)
        except ConstraintError as e:
            return str(e)
        try:
            lltok = self.lltokenizer
        except Exception as e:  # e.g. a slow (non-"fast") Hugging Face tokenizer
            return (
                "response_format: this model's tokenizer cannot be used for constrained "
                f"decoding ({type(e).__name__}: {e}); send the job without response_format"
            )
        matcher = llguidance.LLMatcher(lltok, grammar or "", log_level=0)
        if matcher.is_error():
            return f"response_format: cannot be enforced for this model: {matcher.get_error()}"
        return matcher


class ConstraintBatch:
    """The constrained rows of a batch, each under a slot id the engine chooses."""

    def __init__(self, grammars: Grammars, threads: int | None = None) -> None:
        self.grammars = grammars
        self._executor: llguidance.LLExecutor | None = None
        self._threads = threads
        self.jobs: dict[Hashable, JobConstraint] = {}
        self.failures: dict[Hashable, str] = {}  # slot -> why its matcher failed
        self._scratch = np.empty((0, 0), dtype=np.int32)  # prepare's masks, reused

    @property
    def width(self) -> int:
        """32-bit words in a mask row (one bit per token of the model's logits)."""
        return (self.grammars.vocab_size + 31) // 32

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._threads)
        return self._executor

    def track(self, slot: Hashable, job: JobConstraint) -> None:
        """Constrain the row in ``slot`` from its next mask on."""
        self.jobs[slot] = job

    def drop(self, slot: Hashable) -> None:
        """Forget a row (finished, cancelled or failed)."""
        self.jobs.pop(slot, None)
        self.failures.pop(slot, None)

    def accept(self, slots: Sequence[Hashable], tokens: Sequence[int]) -> None:
        """Advance the matchers of ``slots`` (those started) by their sampled tokens.

        One by one: a token's advance takes about a microsecond, and llguidance's
        ``consume_token_par`` cost twice a plain loop for 64-256 matchers (its per-call
        work, on 1 or 2 threads alike); the masks are what is worth filling in parallel.
        """
        for slot, token in zip(slots, tokens, strict=True):
            job = self.jobs.get(slot)
            if job is None or not job.started or job.matcher.consume_token(int(token)):
                continue
            why = job.matcher.get_error() or f"token {token} is not allowed here"
            self.failures.setdefault(slot, f"the constraint failed: {why}")

    def masks(self, slots: Sequence[Hashable], out: np.ndarray | None = None) -> np.ndarray:
        """The next-token bitmasks of ``slots`` (rows in that order), filled in parallel;
        into ``out`` (at least as many rows) when every slot is tracked, so that every
        row is written."""
        if out is None:
            out = np.full((max(1, len(slots)), self.width), -1, dtype=np.int32)
        pairs = []
        for i, slot in enumerate(slots):
            if (job := self.jobs.get(slot)) is not None:
                job.started = True
                pairs.append((job.matcher, i))
        if pairs:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, pairs, out)
        for i, slot in enumerate(slots):
            job = self.jobs.get(slot)
            if job is not None and (why := job.error()) is not None:
                self.failures.setdefault(slot, f"the constraint failed: {why}")
            if slot in self.failures:  # (never decoded unconstrained)
                out[i] = self._eos_mask
        return out[: len(slots)]

    @property
    def _eos_mask(self) -> np.ndarray:
        """A mask that allows only EOS: a failed row ends while the engine fails its job."""
        bits = np.zeros(self.width * 32, dtype=np.uint8)
        bits[self.grammars.lltokenizer.eos_tokens] = 1
        return np.packbits(bits, bitorder="little").view(np.int32)

    def prepare(self) -> Prepared:
        """The next masks of every tracked row (after :meth:`accept`).

        Touches only the matchers (no MLX, no engine state), so it can run on a helper
        thread while the MLX thread works; :meth:`process` takes the result.
        """
        order = list(self.jobs)
        if len(self._scratch) < len(order) or self._scratch.shape[1] != self.width:
            # (a fresh 4 MB array a step for 256 rows of a 128k vocabulary: reuse one)
            self._scratch = np.empty((max(1, len(order)), self.width), dtype=np.int32)
        table, index = distinct_rows(self.masks(order, self._scratch))
        return Prepared({slot: int(i) for slot, i in zip(order, index, strict=True)}, table)

    def process(
        self, logits: mx.array, slots: Sequence[Hashable], prepared: Prepared | None = None
    ) -> mx.array:
        """``logits`` (one row per slot) with the masks of the tracked slots applied
        (``prepared``'s where it has them, filled now for rows it lacks)."""
        n, vocab = logits.shape
        if n != len(slots) or vocab > self.grammars.vocab_size:
            raise ValueError(
                f"logits of shape {logits.shape} for {len(slots)} slots and masks "
                f"{self.grammars.vocab_size} tokens wide"
            )
        rows = [i for i, s in enumerate(slots) if s in self.jobs or s in self.failures]
        if not rows:
            return logits
        have = {} if prepared is None else prepared.rows
        ready = [i for i in rows if slots[i] in have and slots[i] not in self.failures]
        late = [i for i in rows if slots[i] not in have or slots[i] in self.failures]
        # Free rows keep all-ones masks: their logits pass unchanged. (Whole-array copies:
        # a Python loop over 256 rows of a 128k vocabulary costs a millisecond a step.)
        if not late:  # every constrained row prepared: only its distinct masks go up,
            # and the device picks each row's (free rows: an all-ones entry)
            assert prepared is not None
            table, free = prepared.masks, len(prepared.masks)
            if len(ready) < n:
                table = np.concatenate([table, np.full((1, table.shape[1]), -1, np.int32)])
            index = [free] * n
            for i in ready:
                index[i] = have[slots[i]]
            return DeviceMasks(table, index).apply(logits)
        masks = np.full((n, self.width), -1, dtype=np.int32)
        if ready:
            assert prepared is not None
            masks[ready] = prepared.masks[[have[slots[i]] for i in ready]]
        if late:
            masks[late] = self.masks([slots[i] for i in late])
        return DeviceMasks(masks).apply(logits)
