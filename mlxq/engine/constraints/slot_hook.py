"""Structured outputs as the slot engine's batch logits hook, its masks filled beside it.

:class:`ConstraintHook` keys a :class:`~mlxq.engine.constraints.batch.ConstraintBatch` by job and
runs its per-step work (advancing the matchers by the tokens just sampled, filling the
next masks) on one helper thread while the MLX thread launches the step's model part;
sampling then waits for the masks. (mlx-lm's ``BatchGenerator`` has its own adapter,
:mod:`~mlxq.engine.constraints.mlx_lm_hook`.)
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import mlx.core as mx

from mlxq.engine.constraints.batch import ConstraintBatch, Grammars, Prepared, logits_width
from mlxq.engine.constraints.grammar import ConstraintError


class ConstraintHook:
    """Structured outputs as a batch logits hook keyed by job (the slot engine's
    ``BatchLogitsHook``: ``admit``, ``process``, ``accept``, ``release``).

    Call :meth:`check` when a job is added, to fail a bad constraint alone before it
    decodes; :attr:`active` says whether any decoding job is constrained (an engine can
    skip the hook, and keep its pipelining, when none is); :meth:`failures` lists jobs
    whose matcher failed while decoding, for the engine to fail.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.batch = ConstraintBatch(Grammars(tokenizer, vocab_size))
        self._eos = set(tokenizer.eos_token_ids)
        # One helper thread advances the matchers and fills the masks (llguidance works
        # off the GIL) while the MLX thread does the step's bookkeeping. Two tasks: the
        # bookkeeping needs only the advance (it reports failed matchers), sampling the masks.
        self._helper = concurrent.futures.ThreadPoolExecutor(1, "mlxq-masks")
        self._advanced: concurrent.futures.Future[None] | None = None
        self._pending: concurrent.futures.Future[Prepared] | None = None
        self._prepared: Prepared | None = None
        self._released: list[str] = []  # dropped once the helper is done with them
        self.helper_seconds = 0.0  # the helper advancing matchers and filling masks
        self.waited_seconds = 0.0  # callers waiting for it

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any) -> ConstraintHook:
        """A hook for this model's logits and tokenizer."""
        return cls(tokenizer, logits_width(model, tokenizer))

    @property
    def active(self) -> bool:
        released = set(self._released)
        keys = [*self.batch.jobs, *list(self.batch.failures)]  # (the helper adds failures)
        return any(k not in released for k in keys)

    def holds(self, key: str) -> bool:
        """Whether the job is constrained (or its constraint failed)."""
        return key in self.batch.jobs or key in self.batch.failures

    def holds_any(self) -> bool:
        """Whether any job is constrained (or its constraint failed): else none is held."""
        return bool(self.batch.jobs or self.batch.failures)

    def check(self, request: Any) -> str | None:
        """Why this request's ``response_format`` cannot run here, or None (compiles it)."""
        try:
            self.batch.grammars.job(request.response_format)
        except ConstraintError as e:
            return str(e)
        return None

    def admit(self, key: str, request: Any) -> None:
        """A job starts decoding; one whose constraint fails here (not checked at add) is
        listed in :meth:`failures` and only allowed EOS, never left unconstrained."""
        try:
            job = self.batch.grammars.job(request.response_format)
        except ConstraintError as e:
            self.batch.failures[key] = str(e)
            return
        if job is not None:
            self.batch.track(key, job)

    def process(self, logits: mx.array, rows: list[str]) -> mx.array:
        self._settle()
        prepared, self._prepared = self._prepared, None
        return self.batch.process(logits, rows, prepared) if self.active else logits

    def accept(self, rows: list[str], tokens: list[int]) -> None:
        """Advance the matchers by the tokens (EOS: the job ends) and fill the next masks
        on the helper thread; :meth:`failures` waits for the advance, :meth:`process` for
        the masks."""
        self._settle()
        self._prepared = None
        if not self.batch.jobs:
            return
        live = [(r, t) for r, t in zip(rows, tokens, strict=True) if t not in self._eos]
        args = ([r for r, _ in live], [t for _, t in live])
        self._advanced = self._helper.submit(self._timed, self.batch.accept, *args)
        self._pending = self._helper.submit(self._timed, self.batch.prepare)

    def _timed(self, task: Any, *args: Any) -> Any:
        """Run ``task`` on the helper thread, counting its time."""
        tic = time.perf_counter()
        try:
            return task(*args)
        finally:
            self.helper_seconds += time.perf_counter() - tic

    def _wait(self, future: concurrent.futures.Future[Any]) -> Any:
        """The helper's result, counting the time spent waiting for it."""
        tic = time.perf_counter()
        try:
            return future.result()
        finally:
            self.waited_seconds += time.perf_counter() - tic

    def _settle(self) -> None:
        """Wait for the helper's masks, if any are coming (re-raises its errors)."""
        self._settle_advance()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._prepared = self._wait(pending)
        for key in self._released:
            self.batch.drop(key)
        self._released.clear()

    def _settle_advance(self) -> None:
        """Wait for the helper's advance of the matchers (re-raises its errors)."""
        if self._advanced is not None:
            advanced, self._advanced = self._advanced, None
            self._wait(advanced)

    def release(self, key: str) -> None:
        self._released.append(key)
        if self._pending is None:  # else the helper may still fill its mask
            self._settle()

    def failures(self) -> dict[str, str]:
        """Jobs whose constraint failed (key -> why); they stay listed until released.
        (Failures found filling the next masks show up a step later, as EOS-only rows.)"""
        self._settle_advance()
        return dict(self.batch.failures)  # type: ignore[arg-type]
