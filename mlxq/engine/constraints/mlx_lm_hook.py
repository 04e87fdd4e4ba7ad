"""Structured outputs on mlx-lm's ``BatchGenerator``: one mask fill and one masking op per
decode step for the whole batch.

``BatchGenerator`` runs logits processors row by row, and once any row has one, every row
of every step goes through that per-row path (a slice per row and a concatenation: +35 %
CPU time on the tiny model). So constrained rows use a processor only for their first
token (the initial mask, in the small batch a prefill just finished), and then leave it:
the model is wrapped (:class:`MaskingModel`), and each decode call of the generation batch
gets every constrained row masked at once. The wrapper sees the step's input tokens (the
ones just sampled), so it starts the forward pass, reads them, advances the matchers and
fills all masks in one parallel ``LLExecutor`` call while the model runs, then applies the
masks with one MLX op.

mlx-lm 0.32's private ``BatchGenerator._generation_batch`` (its ``uids``, ``prompt_cache``
and ``logits_processors``) is read here and nowhere else: it tells decode calls from
prefill calls and rows from uids.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator

from mlxq.engine.constraints.batch import ConstraintBatch, Grammars, JobConstraint
from mlxq.engine.constraints.device_masks import DeviceMasks
from mlxq.wire import ResponseFormat


class RowProcessor:
    """The logits processor of a constrained row for its first token (the initial mask)."""

    def __init__(self, owner: BatchGeneratorConstraints, job: JobConstraint) -> None:
        self.owner, self.job = owner, job
        self.uid: int | None = None  # set once the generator has given the row its uid

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.job.started or self.uid not in self.owner.batch.jobs:
            return logits  # (masked by MaskingModel from its second token on)
        self.owner.seated = True  # leaves the per-row path after this step
        return DeviceMasks(self.owner.batch.masks([self.uid])).apply(logits)


class MaskingModel:
    """The model, with the generation batch's decode logits masked for constrained rows."""

    def __init__(self, model: Any, owner: BatchGeneratorConstraints) -> None:
        self.model, self.owner = model, owner

    def __getattr__(self, name: str) -> Any:  # layers, make_cache, args...: the model's
        if name in ("model", "owner"):  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        out = self.model(inputs, cache=cache, **kwargs)
        return self.owner.mask_decode(inputs, cache, out)


class BatchGeneratorConstraints:
    """A :class:`ConstraintBatch` keyed by ``BatchGenerator`` uid."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.batch = ConstraintBatch(Grammars(tokenizer, vocab_size))
        self.gen: BatchGenerator | None = None
        self.seated = False  # a row got its first mask this step

    def job(self, fmt: ResponseFormat | None) -> JobConstraint | None:
        """A job's constraint (None for free text); raises ``ConstraintError``."""
        return self.batch.grammars.job(fmt)

    def wrap(self, model: Any) -> MaskingModel:
        """The model to build the ``BatchGenerator`` on."""
        return MaskingModel(model, self)

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
        """Before ``gen.next()``."""
        self.gen = gen

    def after_step(self) -> None:
        """After ``gen.next()``: rows that got their first mask leave the per-row path."""
        if not self.seated or self.gen is None:
            return
        self.seated = False
        lps = self.gen._generation_batch.logits_processors
        for i, procs in enumerate(lps):
            if any(isinstance(p, RowProcessor) for p in procs):
                lps[i] = tuple(p for p in procs if not isinstance(p, RowProcessor))

    def mask_decode(self, inputs: mx.array, cache: Any, out: mx.array) -> mx.array:
        """``out`` (rows, 1, vocab), masked when it is the generation batch's decode call."""
        jobs = self.batch.jobs
        if not jobs or self.gen is None:
            return out
        batch = self.gen._generation_batch
        if cache is not batch.prompt_cache:  # a prefill, or a new batch's first token
            return out
        rows = [(i, u) for i, u in enumerate(batch.uids) if u in jobs]
        if not rows:
            return out
        mx.async_eval(out)  # the model runs while the CPU fills the masks
        tokens = inputs.reshape(-1).tolist()
        taken = [(i, u) for i, u in rows if jobs[u].started]
        self.batch.accept([u for _, u in taken], [tokens[i] for i, _ in taken])
        masks = self.batch.masks([u for _, u in rows])
        full = np.full((len(batch.uids), masks.shape[1]), -1, dtype=np.int32)
        full[[i for i, _ in rows]] = masks  # free rows: all ones, their logits unchanged
        return DeviceMasks(full).apply(out[:, -1, :])[:, None, :]
