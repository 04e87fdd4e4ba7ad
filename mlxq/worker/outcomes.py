"""What a worker holds (:class:`InFlight`) and the results it builds for them: tokens,
usage and timing from the engine's Completion. Writing them is ``writeback``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import msgspec
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from mlxq.engine.sampling import Completion
from mlxq.engine.token_bytes import token_bytes_for
from mlxq.wire import FinishReason, JobMeta, Request, Result, Timing, Usage
from mlxq.worker.vetting import Vetted


@dataclass
class InFlight:
    """A job this worker holds: registered with RQ and handed to the MLX thread."""

    job: Job
    queue: Queue
    execution: Execution
    request: Request
    meta: JobMeta
    started_at: float
    stop_reason: FinishReason | None = None  # "timeout"/"cancelled" when the worker stopped it
    prompt_tokens: int = 0  # as vetting tokenized it: usage for jobs the engine never counted

    @classmethod
    def of(cls, job: Job, queue: Queue, execution: Execution, v: Vetted, at: float) -> InFlight:
        """A registered job that passed vetting, handed to the MLX thread at ``at``."""
        return cls(job, queue, execution, v.request, v.meta, at, None, len(v.tokens))


def build_result(
    inf: InFlight, c: Completion, model: str, worker: str, tokenizer: Any = None
) -> Result:
    """The stored result of a job: tokens, usage and timing (and its samples' choices).

    With ``tokenizer``, logprobs name each token's UTF-8 bytes (the OpenAI formats' token
    text): per token, so here on the worker's thread rather than the MLX thread.
    """
    if tokenizer is not None and inf.request.logprobs is not None:
        c = _with_token_bytes(c, tokenizer)
    n = c.completion_tokens
    # A job the worker stopped ends "cancelled" in the engine; say why it was stopped.
    stopped = c.finish_reason == "cancelled" and inf.stop_reason is not None
    reason = inf.stop_reason if stopped and inf.stop_reason else c.finish_reason
    error = c.error
    prompt = c.prompt_tokens or inf.prompt_tokens  # a job that never ran still had a prompt
    if reason == "timeout" and error is None:
        error = f"stopped after the job's {inf.job.timeout}s time limit"
    return Result(
        job_id=inf.job.id,
        custom_id=inf.request.custom_id or inf.meta.custom_id,
        finish_reason=reason,
        text=c.text,
        token_ids=c.token_ids,
        usage=Usage(prompt, n, prompt + n),
        logprobs=c.logprobs,
        error=error,
        model=model,
        worker=worker,
        batch_id=inf.meta.batch_id,
        index=inf.meta.index,
        metadata=inf.request.metadata,
        timing=_timing(inf, c),
        choices=c.choices,
    )


def _with_token_bytes(c: Completion, tokenizer: Any) -> Completion:
    names = token_bytes_for(tokenizer)
    choices = c.choices and [
        msgspec.structs.replace(ch, logprobs=names.named(ch.logprobs)) for ch in c.choices
    ]
    return replace(c, logprobs=names.named(c.logprobs), choices=choices)


def unrun_result(inf: InFlight, reason: str, error: str, model: str, worker: str) -> Result:
    """The result of a job stopped before it generated anything (expired, cancelled)."""
    c = Completion(key=inf.job.id, finish_reason="cancelled", error=error)
    result = build_result(inf, c, model, worker)
    return msgspec.structs.replace(result, finish_reason=reason)


def _timing(inf: InFlight, c: Completion) -> Timing:
    enqueued = inf.job.enqueued_at.timestamp() if inf.job.enqueued_at else None
    n = c.completion_tokens
    return Timing(
        enqueued_at=enqueued,
        started_at=inf.started_at,
        first_token_at=c.first_token_at,
        finished_at=c.finished_at or None,
        queue_wait_s=_diff(inf.started_at, enqueued),
        ttft_s=_diff(c.first_token_at, inf.started_at),
        prefill_tps=_rate(c.prompt_tokens, c.prefill_seconds),
        decode_tps=_rate(n - 1, c.decode_seconds),
    )


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else max(0.0, end - start)


def _rate(count: int, seconds: float | None) -> float | None:
    return count / seconds if seconds and count > 0 else None
