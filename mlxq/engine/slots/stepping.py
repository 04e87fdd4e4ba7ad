"""How the slot engine runs a decode step: launch it, do the last one's bookkeeping meanwhile.

A mixin of :class:`~mlxq.engine.slots.engine.SlotEngine` (the engine's state is its own),
as :mod:`mlxq.engine.slots.joining` is for joins; the step itself (inputs, forward,
sampling) is :mod:`mlxq.engine.slots.decode`.

Free steps are built and launched whole while the last one computes. A step whose rows
need host tokens to sample (hooks that act, such as constraints; per-row processors) is
built first (its inputs are the last step's tokens on the device); then the hooks get
those tokens on the host and prepare their masks on a helper thread while this thread
launches the model's part (most of a CUDA step's host time is MLX's launch) and records
the last step; it is sampled last.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxq.engine.prompts import error_line
from mlxq.engine.sampling import Completion, StreamChunk
from mlxq.engine.slots.decode import (
    Row,
    Step,
    TraceFailed,
    relayed_step,
    run_forward,
    sample_step,
)
from mlxq.engine.slots.rows import RowTable
from mlxq.wire import FinishReason

log = logging.getLogger("mlxq.engine.slots.engine")


@dataclass
class _Launch:
    """A decode step started: the whole step, or (rows that sample later) its logits and
    the last step's host tokens; ``failed``: the batch failed instead."""

    step: Step | None = None
    logits: mx.array | None = None
    tokens: list[int] | None = None
    failed: list[Completion] | None = None


class Stepping:
    """Decode steps over the slot engine's rows (the state below is the engine's)."""

    model: Any
    tokenizer: Any
    choices: Any
    hooks: list[Any]
    _cache: Any
    _constraints: Any
    _forward: Any
    _stats: Any
    _eos: set[int]
    _rows: RowTable
    _chunks: list[StreamChunk]
    _inflight: Step | None
    relayed: bool
    info: Any

    _keys: dict[str, int]
    _samples: dict[str, Any]
    _fail_batch: Callable[[Exception], list[Completion]]  # (the engine's)

    def _decode(self) -> list[Completion]:
        """Wait for the step in flight (except where steps overlap), launch the next (see
        the module docstring), then do the bookkeeping of the one before."""
        tic = time.perf_counter()
        # Hooks that act need host tokens each step; an idle one (no constrained row) does not.
        hooks_act = any(getattr(h, "active", True) for h in self.hooks)
        prev, rows = self._inflight, self._launchable()
        sync = hooks_act or (self._rows.processors > 0 and any(r.processors for r in rows))
        if prev is not None and not self.choices.overlap:
            # Wait for it (not for its bookkeeping): while a computation that reads the
            # cache is pending, the next step's writes would copy every layer's cache.
            mx.eval(prev.sampled, prev.logprobs)
        launch = self._launch(rows, prev, sync) if rows else _Launch()
        if launch.failed is not None:
            return launch.failed
        self._inflight = launch.step
        done = [] if prev is None else self._collect(prev, launch.tokens)
        if launch.logits is not None:
            sampling = time.perf_counter()
            done += self._sample_after(rows, launch.logits)
            self._stats.sample_launch_seconds += time.perf_counter() - sampling
        self._stats.decode_seconds += time.perf_counter() - tic
        return done

    def _launch(self, rows: list[Row], prev: Step | None, sync: bool) -> _Launch:
        """Build and launch the next step of ``rows``; with ``sync``, only its model's part,
        the hooks handed ``prev``'s tokens between the build and the launch."""
        built, waited, out = time.perf_counter(), 0.0, _Launch()
        try:
            logits = self._forward_logits(rows, prev)
            if not sync:
                out.step = self._sample(rows, logits)
            else:
                if prev is not None:
                    tic = time.perf_counter()
                    out.tokens, lost = self._hand_tokens(prev)
                    if out.tokens is None:
                        return _Launch(failed=lost)
                    waited = time.perf_counter() - tic
                mx.async_eval(logits)
                out.logits = logits
        except Exception as exc:
            return _Launch(failed=self._fail_batch(exc))
        self._stats.launch_seconds += time.perf_counter() - built - waited
        self._stats.token_wait_seconds += waited
        self._stats.decode_steps += 1
        return out

    def _forward_logits(self, rows: list[Row], prev: Step | None) -> mx.array:
        """The model's part of the step. A compiled forward that fails to trace (a model
        whose code the tracer cannot follow) gives way to the eager one for good, with a
        warning, and the step runs eagerly; any other error is the step's own."""
        args = (self.model, self._cache, self.choices.kernel, rows, prev, self.choices.saving)
        if self._forward is not None:
            try:
                return run_forward(*args, self._forward)
            except TraceFailed as exc:
                log.warning(
                    "the compiled decode forward failed (%s): decoding eagerly from now on "
                    "(MLXQ_SLOT_COMPILE=0 skips it)",
                    error_line(exc),
                )
                self._forward = None
                self.choices = dataclasses.replace(self.choices, compiled=False)
        return run_forward(*args)

    def _sample_after(self, rows: list[Row], logits: mx.array) -> list[Completion]:
        """Sample a launched forward once the host has the step before's tokens (rows that
        ended meanwhile are dropped)."""
        live = [i for i, _ in self._live(rows)]
        if not live:
            return []
        if len(live) < len(rows):
            rows, logits = [rows[i] for i in live], logits[mx.array(live)]
        try:
            self._inflight = self._sample(rows, logits)
        except Exception as exc:
            return self._fail_batch(exc)
        return []

    def _sample(self, rows: list[Row], logits: mx.array) -> Step:
        """Sample the step, or (a pipeline stage that does not sample) leave its tokens
        to be delivered."""
        if self.relayed:
            return relayed_step(rows, self.info.vocab_size, self.hooks)
        return sample_step(rows, logits, self.hooks)

    def _launchable(self) -> list[Row]:
        """Rows to decode next, in slot order: all but those whose step in flight gives
        them their last token (``max_tokens``): their cache length, one more per step
        launched, has reached its :attr:`~Row.limit`."""
        held = self._cache.lengths
        return [r for r in self._rows.ordered() if held[r.slot] < r.limit]

    def _hand_tokens(
        self, step: Step, live: list[tuple[int, Row]] | None = None
    ) -> tuple[list[int] | None, list[Completion]]:
        """The step's sampled tokens on the host, handed to the hooks for the rows still
        decoding (``live``, if known); or None and the batch failed."""
        try:
            tokens = step.sampled.tolist()
        except Exception as exc:
            self._inflight = None
            return None, self._fail_batch(exc)
        live = self._live(step.rows) if live is None else live
        keys = [r.run.job.key for _, r in live]
        for hook in self.hooks:
            hook.accept(keys, [tokens[i] for i, _ in live])
        return tokens, []

    def _live(self, rows: list[Row]) -> list[tuple[int, Row]]:
        """The ``rows`` (index among them, row) that still decode: not finished meanwhile."""
        row_at = self._rows.get
        return [(i, r) for i, r in enumerate(rows) if row_at(r.slot) is r]

    def _collect(self, step: Step, tokens: list[int] | None = None) -> list[Completion]:
        """The step's tokens to the host, handed to the hooks (unless they have had them:
        ``tokens``): record them, finish rows that ended. Free rows first: only
        constrained rows wait for their matchers' advance (on the hook's helper thread),
        which may have failed them."""
        live = self._live(step.rows)
        if tokens is None:
            tokens, lost = self._hand_tokens(step, live)
            if tokens is None:
                return lost
        free, held = live, []
        if self._constraints.holds_any():
            free = []
            for i, r in live:
                (held if self._constraints.holds(r.run.job.key) else free).append((i, r))
        done = self._record(step, tokens, free)
        if held:
            failed = self._constraints.failures()
            for _, r in held:
                if (k := r.run.job.key) in failed:
                    done += self._finish(r.slot, "error", failed[k])
            done += self._record(
                step, tokens, [(i, r) for i, r in held if r.run.job.key not in failed]
            )
        return done

    def _record(
        self, step: Step, tokens: list[int], live: list[tuple[int, Row]]
    ) -> list[Completion]:
        """Record the ``live`` rows' tokens (index in the step, row); finish those that ended."""
        if not live:
            return []
        done: list[Completion] = []
        # (Output tokens, as results count them: an EOS ends a row and is not output.)
        self._stats.generated_tokens += sum(tokens[i] not in self._eos for i, _ in live)
        # (No row asking for logprobs: no row to look at for them.)
        lp = step.picked_logprobs(tokens, live, self._eos) if self._rows.logprobs else {}
        now, eos = time.time(), self._eos
        for i, row in live:
            token, run = tokens[i], row.run
            if run.first_token_at is None:
                run.first_token_at = now
            run.last_token_at = now
            reason: FinishReason | None = None
            if token in eos:
                reason = "stop"  # EOS: not part of the output
            elif row.plain:
                run.tokens.append(token)  # (what add_token does for it, without the call)
            elif run.add_token(token, lp.get(i)):
                reason = "stop"
            if reason is None and len(run.tokens) >= row.max_tokens:
                reason = "length"
            if reason is not None:
                done += self._finish(row.slot, reason)
            else:
                row.next_input = token
                if row.stream:
                    run.stream_update(self.tokenizer, self._chunks)
        return done

    def _finish(
        self, slot: int, reason: FinishReason, error: str | None = None
    ) -> list[Completion]:
        """End the row in ``slot``: its job's Completion, or none while other samples of
        its job still run (:mod:`~mlxq.engine.slots.samples`)."""
        row = self._rows.pop(slot)
        run = row.run
        del self._keys[run.job.key]
        self._cache.free(slot)  # bookkeeping only
        for hook in self.hooks:
            hook.release(run.job.key)
        if run.plan is not None:
            run.plan.release()
        done = run.finish(reason, self.tokenizer, self._chunks, error)
        if row.samples is None:
            return [done]
        whole = row.samples.finished(row.index, done)
        if whole is None:
            return []
        del self._samples[row.samples.key]
        return [whole]
