"""Structured outputs on mlx-lm's ``BatchGenerator``: per-row logits processors, masks filled
once per step for the whole batch.

``BatchGenerator`` runs logits processors row by row, and a row's processor sees the token
just sampled for it only as its own lazy context. To fill every constrained row's mask in
one parallel ``LLExecutor`` call, :meth:`BatchGeneratorConstraints.before_step` notes the
generation batch's rows and their pending tokens (mlx-lm 0.32's ``_generation_batch.uids``
and ``._next_tokens``: the one private read, here only); the first constrained processor
of the step then starts the forward pass (``async_eval``), reads the tokens, advances all
matchers and fills all masks while the model runs, and each processor applies its row.
A row whose token was not noted (a newer mlx-lm) takes its own token from its context.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from mlxq.engine.constraints import ConstraintBatch, DeviceMasks, Grammars, JobConstraint
from mlxq.wire import ResponseFormat


class RowProcessor:
    """The logits processor of one constrained row (mlx-lm's ``(tokens, logits)`` shape)."""

    def __init__(self, owner: BatchGeneratorConstraints, job: JobConstraint) -> None:
        self.owner, self.job = owner, job
        self.uid: int | None = None  # set once the generator has given the row its uid

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self.owner.masked(self, tokens, logits)


class BatchGeneratorConstraints:
    """A :class:`ConstraintBatch` keyed by ``BatchGenerator`` uid."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.batch = ConstraintBatch(Grammars(tokenizer, vocab_size))
        self._pending: tuple[list[int], mx.array] | None = None
        self._rows: dict[int, int] = {}  # uid -> row of _masks, this step
        self._masks: DeviceMasks | None = None

    def job(self, fmt: ResponseFormat | None) -> JobConstraint | None:
        """A job's constraint (None for free text); raises ``ConstraintError``."""
        return self.batch.grammars.job(fmt)

    def processor(self, job: JobConstraint) -> RowProcessor:
        """The processor to insert a constrained job with; :meth:`track` it once it has a uid."""
        job.reset()
        return RowProcessor(self, job)

    def track(self, uid: int, processor: RowProcessor) -> None:
        processor.uid = uid
        self.batch.track(uid, processor.job)

    def drop(self, uid: int) -> None:
        self.batch.drop(uid)

    def failures(self) -> dict[int, str]:
        """Rows whose matcher failed (uid -> why), cleared as they are dropped."""
        return dict(self.batch.failures)  # type: ignore[arg-type]

    def before_step(self, gen: BatchGenerator) -> None:
        """Note the decoding rows and their pending tokens, before ``gen.next()``."""
        self._masks, self._rows, self._pending = None, {}, None
        if not self.batch.jobs:
            return
        batch = getattr(gen, "_generation_batch", None)
        uids, tokens = getattr(batch, "uids", None), getattr(batch, "_next_tokens", None)
        if uids and tokens is not None and any(u in self.batch.jobs for u in uids):
            self._pending = (list(uids), tokens)

    def masked(self, row: RowProcessor, tokens: mx.array, logits: mx.array) -> mx.array:
        """The (1, vocab) ``logits`` of ``row`` with its mask for this step applied."""
        uid, job, vocab = row.uid, row.job, logits.shape[-1]
        if not job.started:  # its first mask: no token to take yet
            return DeviceMasks(self.batch.masks([uid]), vocab).apply(logits)
        if self._pending is not None:
            self._fill_all(logits)
        if uid in self._rows and self._masks is not None:
            return self._masks.apply(logits, self._rows[uid])
        self.batch.accept([uid], [tokens[-1].item()])  # not noted: its own token
        return DeviceMasks(self.batch.masks([uid]), vocab).apply(logits)

    def _fill_all(self, logits: mx.array) -> None:
        """Advance every noted constrained row by its token and fill all their masks."""
        assert self._pending is not None
        uids, pending = self._pending
        self._pending = None
        mx.async_eval(logits)  # the model runs while the CPU fills the masks
        jobs = self.batch.jobs
        rows = [(u, t) for u, t in zip(uids, pending.tolist(), strict=True) if u in jobs]
        rows = [(u, t) for u, t in rows if jobs[u].started]
        if not rows:
            return
        slots = [u for u, _ in rows]
        self.batch.accept(slots, [t for _, t in rows])
        self._masks = DeviceMasks(self.batch.masks(slots), logits.shape[-1])
        self._rows = {u: i for i, u in enumerate(slots)}
