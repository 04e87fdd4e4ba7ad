"""A job of ``n`` samples in the slot engine: one prompt, prefilled once, decoded in n rows.

The job's prompt is prefilled as one row of its group; its keys and values are written
into each of its ``n`` slots (:mod:`mlxq.engine.slots.joiner`). From there every sample is
a row of its own: its own :class:`~mlxq.engine.sampling.RunningJob` under the key
``"<job key>#<i>"`` (hooks such as constraints hold a matcher per sample), its own
sampler seeded ``seed + i``, its own stop strings and finish. :class:`Samples` gathers
the samples' completions; the job's :class:`~mlxq.engine.sampling.Completion` comes when
the last one ends, with a :class:`~mlxq.wire.Choice` per sample. A job stopped whole
(cancelled) ends every sample that still runs and says so as the job's reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxq.engine.sampling import Completion, EngineJob, RunningJob
from mlxq.wire import Choice, FinishReason

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


def sample_key(key: str, index: int) -> str:
    """The engine key of sample ``index`` of job ``key``."""
    return f"{key}#{index}"


@dataclass
class Samples:
    """The samples of one job (``run``: the job's own record, for its prompt and times)."""

    run: RunningJob
    done: dict[int, Completion] = field(default_factory=dict)
    stopped: FinishReason | None = None  # the job was stopped whole, for this reason

    @property
    def key(self) -> str:
        """The job's key."""
        return self.run.job.key

    @property
    def n(self) -> int:
        """How many samples the job asked for."""
        return self.run.job.request.n

    def start(self, index: int, tokenizer: TokenizerWrapper) -> RunningJob:
        """The running record of sample ``index`` (admitted when the job was)."""
        job = EngineJob(sample_key(self.key, index), self.run.job.request)
        run = RunningJob.start(job, self.run.prompt, tokenizer, self.run.admitted_at)
        run.plan = self.run.plan if index == 0 else None  # (released once, by sample 0)
        return run

    def finished(self, index: int, completion: Completion) -> Completion | None:
        """Record sample ``index``'s end; the job's Completion once every sample ended."""
        self.done[index] = completion
        return self.completion() if len(self.done) == self.n else None

    def completion(self) -> Completion:
        """The job's Completion: choice 0's output at the top, a choice per sample."""
        parts = [self.done[i] for i in range(self.n)]
        first = parts[0]
        starts = [p.first_token_at for p in parts if p.first_token_at is not None]
        ends = [
            p.first_token_at + p.decode_seconds
            for p in parts
            if p.first_token_at is not None and p.decode_seconds is not None
        ]
        began, admitted = min(starts, default=None), self.run.admitted_at
        return Completion(
            key=self.key,
            finish_reason=self.stopped or first.finish_reason,
            text=first.text,
            token_ids=first.token_ids,
            prompt_tokens=len(self.run.prompt),
            logprobs=first.logprobs,
            error=next((p.error for p in parts if p.error), None),
            admitted_at=admitted,
            first_token_at=began,
            finished_at=time.time(),
            prefill_seconds=None if began is None else began - admitted,
            decode_seconds=None if began is None or not ends else max(ends) - began,
            choices=[
                Choice(i, p.finish_reason, p.text, p.token_ids, p.logprobs)
                for i, p in enumerate(parts)
            ],
        )
