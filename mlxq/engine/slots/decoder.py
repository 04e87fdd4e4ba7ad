"""How the slot engine runs a decode step: launch it, do the last one's bookkeeping meanwhile.

:class:`Decoder` steps the rows of a :class:`~mlxq.engine.slots.batch.SlotBatch`: it
launches the next step, then collects the one before (its tokens to the host, each
row's output recorded, rows that ended finished). The step itself (inputs, forward,
sampling) is :mod:`mlxq.engine.slots.step`.

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
from dataclasses import dataclass

import mlx.core as mx

from mlxq.engine.constraints.slot_hook import ConstraintHook
from mlxq.engine.prompts import error_line
from mlxq.engine.sampling import Completion
from mlxq.engine.slots.batch import SlotBatch
from mlxq.engine.slots.compiled import TraceFailed
from mlxq.engine.slots.prefill_streams import cpu_streams
from mlxq.engine.slots.step import Row, Step, relayed_step, run_forward, sample_step
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


class Decoder:
    """Decode steps over a batch's rows; ``constraints`` (one of the batch's hooks) may
    hold rows back until their matchers advanced. A pipeline stage that does not sample
    is ``relayed``: its tokens come through :meth:`deliver`."""

    def __init__(self, batch: SlotBatch, constraints: ConstraintHook) -> None:
        self.batch, self.constraints = batch, constraints
        self.relayed = False
        count = batch.choices.decode_streams
        self.streams = cpu_streams(count) if count > 1 else None

    def deliver(self, tokens: list[int]) -> None:
        """The sampled tokens of the step in flight (a stage that does not sample)."""
        step = self.batch.inflight
        if step is None or step.sampled is not None or len(step.rows) != len(tokens):
            rows = "none" if step is None else len(step.rows)
            raise RuntimeError(
                f"pipeline out of step: {len(tokens)} tokens for a step of {rows} rows"
            )
        step.sampled = mx.array(tokens, dtype=mx.uint32)

    def step(self) -> list[Completion]:
        """Wait for the step in flight (except where steps overlap), launch the next (see
        the module docstring), then do the bookkeeping of the one before."""
        tic, b = time.perf_counter(), self.batch
        # Hooks that act need host tokens each step; an idle one (no constrained row) does not.
        hooks_act = any(getattr(h, "active", True) for h in b.hooks)
        prev, rows = b.inflight, self._launchable()
        sync = hooks_act or (b.rows.processors > 0 and any(r.processors for r in rows))
        if prev is not None and not b.choices.overlap:
            # Wait for it (not for its bookkeeping): while a computation that reads the
            # cache is pending, the next step's writes would copy every layer's cache.
            mx.eval(prev.sampled, prev.logprobs)
        launch = self._launch(rows, prev, sync) if rows else _Launch()
        if launch.failed is not None:
            return launch.failed
        b.inflight = launch.step
        done = [] if prev is None else self._collect(prev, launch.tokens)
        if launch.logits is not None:
            sampling = time.perf_counter()
            done += self._sample_after(rows, launch.logits)
            b.stats.sample_launch_seconds += time.perf_counter() - sampling
        b.stats.decode_seconds += time.perf_counter() - tic
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
            return _Launch(failed=self.batch.fail(exc))
        stats = self.batch.stats
        stats.launch_seconds += time.perf_counter() - built - waited
        stats.token_wait_seconds += waited
        stats.decode_steps += 1
        return out

    def _forward_logits(self, rows: list[Row], prev: Step | None) -> mx.array:
        """The model's part of the step. A compiled forward that fails to trace (a model
        whose code the tracer cannot follow) gives way to the eager one for good, with a
        warning, and the step runs eagerly; any other error is the step's own."""
        b = self.batch
        args = (b.model, b.cache, b.choices.kernel, rows, prev, b.choices.saving)
        if b.forward is not None:
            try:
                return run_forward(*args, b.forward)  # (one graph: no streams)
            except TraceFailed as exc:
                log.warning(
                    "the compiled decode forward failed (%s): decoding eagerly from now on "
                    "(MLXQ_SLOT_COMPILE=0 skips it)",
                    error_line(exc),
                )
                b.forward = None
                b.choices = dataclasses.replace(b.choices, compiled=False)
        return run_forward(*args, streams=self.streams)

    def _sample_after(self, rows: list[Row], logits: mx.array) -> list[Completion]:
        """Sample a launched forward once the host has the step before's tokens (rows that
        ended meanwhile are dropped)."""
        live = [i for i, _ in self._live(rows)]
        if not live:
            return []
        if len(live) < len(rows):
            rows, logits = [rows[i] for i in live], logits[mx.array(live)]
        try:
            self.batch.inflight = self._sample(rows, logits)
        except Exception as exc:
            return self.batch.fail(exc)
        return []

    def _sample(self, rows: list[Row], logits: mx.array) -> Step:
        """Sample the step, or (a pipeline stage that does not sample) leave its tokens
        to be delivered."""
        hooks = self.batch.hooks
        if self.relayed:
            return relayed_step(rows, self.batch.info.vocab_size, hooks)
        return sample_step(rows, logits, hooks)

    def _launchable(self) -> list[Row]:
        """Rows to decode next, in slot order: all but those whose step in flight gives
        them their last token (``max_tokens``): their cache length, one more per step
        launched, has reached its :attr:`~Row.limit`."""
        held = self.batch.cache.lengths
        return [r for r in self.batch.rows.ordered() if held[r.slot] < r.limit]

    def _hand_tokens(
        self, step: Step, live: list[tuple[int, Row]] | None = None
    ) -> tuple[list[int] | None, list[Completion]]:
        """The step's sampled tokens on the host, handed to the hooks for the rows still
        decoding (``live``, if known); or None and the batch failed."""
        try:
            tokens = step.sampled.tolist()
        except Exception as exc:
            self.batch.inflight = None
            return None, self.batch.fail(exc)
        live = self._live(step.rows) if live is None else live
        keys = [r.run.job.key for _, r in live]
        for hook in self.batch.hooks:
            hook.accept(keys, [tokens[i] for i, _ in live])
        return tokens, []

    def _live(self, rows: list[Row]) -> list[tuple[int, Row]]:
        """The ``rows`` (index among them, row) that still decode: not finished meanwhile."""
        row_at = self.batch.rows.get
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
        if self.constraints.holds_any():
            free = []
            for i, r in live:
                (held if self.constraints.holds(r.run.job.key) else free).append((i, r))
        done = self._record(step, tokens, free)
        if held:
            failed = self.constraints.failures()
            for _, r in held:
                if (k := r.run.job.key) in failed:
                    done += self.batch.finish(r.slot, "error", failed[k])
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
        b = self.batch
        done: list[Completion] = []
        # (Output tokens, as results count them: an EOS ends a row and is not output.)
        b.stats.generated_tokens += sum(tokens[i] not in b.eos for i, _ in live)
        # (No row asking for logprobs: no row to look at for them.)
        lp = step.picked_logprobs(tokens, live, b.eos) if b.rows.logprobs else {}
        now, eos = time.time(), b.eos
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
                done += b.finish(row.slot, reason)
            else:
                row.next_input = token
                if row.stream:
                    run.stream_update(b.tokenizer, b.chunks)
        return done
