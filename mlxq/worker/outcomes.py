"""Writing finished jobs back to RQ: results, statuses and registries, many per round trip.

Every result is written only if this worker still holds the job (``ownership``): a worker
that slept past its heartbeat finds its jobs handed to someone else, and its late results
are dropped, never written twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import redis
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.worker import BaseWorker

from mlxq.broker.rq_store import end_script, ownership, transitions
from mlxq.engine.sampling import Completion
from mlxq.engine.token_bytes import token_bytes_for
from mlxq.wire import FinishReason, JobMeta, Request, Result, Timing, Usage


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


@dataclass
class Written:
    """What became of results sent to Redis: the jobs this worker had lost meanwhile, and
    the results Redis refused, each with its error (the rest were written)."""

    lost: list[InFlight] = field(default_factory=list)
    refused: list[tuple[InFlight, Result, redis.ResponseError]] = field(default_factory=list)

    def add(self, other: Written) -> None:
        """Take in the outcome of another write."""
        self.lost += other.lost
        self.refused += other.refused


def write_results(worker: BaseWorker, done: list[tuple[InFlight, Result]]) -> Written:
    """Store results of jobs this worker still holds.

    Finished jobs (most) end through :mod:`~mlxq.broker.rq_store.end_script`, one script
    call each, and Redis answers for each alone; the others through RQ's objects, in one
    transaction, tried again job by job when Redis refuses it. A lost connection raises.
    """
    fast: list[tuple[InFlight, Result]] = []
    rest: list[tuple[InFlight, Result]] = []
    for inf, r in done:
        (fast if end_script.applies(inf.job, r) else rest).append((inf, r))
    endings = [end_script.Ending(inf.job, inf.queue, inf.execution, r) for inf, r in fast]
    written = Written()
    for (inf, r), ok in zip(fast, end_script.end_finished(worker, endings), strict=True):
        if isinstance(ok, redis.ResponseError):
            written.refused.append((inf, r, ok))
        elif not ok:
            written.lost.append(inf)
    written.add(_write_through_rq(worker, rest))
    return written


def _write_through_rq(worker: BaseWorker, done: list[tuple[InFlight, Result]]) -> Written:
    """:func:`write_results` for jobs the script does not end, through RQ's objects."""
    if not done:
        return Written()
    try:
        return Written(lost=_transaction(worker, done))
    except redis.ResponseError as e:
        if len(done) == 1:
            return Written(refused=[(*done[0], e)])
        written = Written()  # one bad job fails the transaction: find it
        for item in done:
            written.add(_write_through_rq(worker, [item]))
        return written


def _transaction(worker: BaseWorker, done: list[tuple[InFlight, Result]]) -> list[InFlight]:
    """Write ``done`` in one transaction, for the jobs still held; the jobs found lost."""
    results = {id(inf): result for inf, result in done}

    def write(pipe: Any, inf: InFlight) -> None:
        transitions.end_job(
            pipe,
            inf.job,
            inf.queue,
            results[id(inf)],
            worker=worker,
            execution=inf.execution,
            count=False,
        )

    def count(pipe: Any, ended: list[InFlight]) -> None:
        statuses = [(inf.job, inf.job.get_status(refresh=False)) for inf in ended]
        transitions.count_ended(pipe, worker, statuses)

    infs = [inf for inf, _ in done]
    held = ownership.write_if_held(worker.connection, infs, write, count)
    return [inf for inf, ok in zip(infs, held, strict=True) if not ok]


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
