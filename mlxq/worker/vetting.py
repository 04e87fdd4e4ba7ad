"""Vetting pulled jobs before the engine gets them: a valid mlxq request that this worker
can run (its prompt tokenizes and its KV cache fits), and whether its batch expired.

Nothing here writes to Redis: a refused job is failed through RQ by the worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
from rq.job import Job

from mlxq.broker.intake import JobRejected, decode_job
from mlxq.broker.rq_store import internals
from mlxq.engine.prompts import JobInputError
from mlxq.engine.runner import Runner
from mlxq.wire import JobMeta, Request


@dataclass
class Refused:
    """A job vetting refused: why (one line), and its prompt's tokens where it got that far
    (usage of the failed result)."""

    error: str
    prompt_tokens: int = 0


@dataclass
class Vetted:
    """A job that passed vetting: what the engine runs, unless its batch expired."""

    request: Request
    tokens: list[int]
    meta: JobMeta
    expired: bool


def vet(runner: Runner, job: Job) -> Vetted | Refused:
    """The job, ready for the engine, or why it cannot run (a one-line error)."""
    tokens: list[int] = []
    try:
        request = decode_job(job)
        meta = _meta(job)
        engine, scheduler = runner.engine, runner.scheduler
        assert engine is not None and scheduler is not None
        tokens = engine.encode(request)
        problem = scheduler.fits_alone(len(tokens), request.max_tokens, request.n)
        if problem:
            raise JobRejected(problem)
    except JobInputError as e:
        return Refused(str(e), e.prompt_tokens or len(tokens))
    except JobRejected as e:
        return Refused(str(e), len(tokens))
    except Exception as e:  # a job another producer wrote oddly fails alone, never the worker
        return Refused(f"could not prepare the job: {e!r:.300}", len(tokens))
    late = meta.expires_at is not None and time.time() > meta.expires_at
    return Vetted(request, tokens, meta, late)


def _meta(job: Job) -> JobMeta:
    """The job's mlxq meta, or a rejection naming the field that is wrong."""
    if internals.meta_unreadable(job):
        raise JobRejected("invalid job meta: not JSON (mlxq writes batch_id, index, custom_id)")
    try:
        return msgspec.convert(job.meta or {}, JobMeta)
    except msgspec.ValidationError as e:
        raise JobRejected(f"invalid job meta: {e} (mlxq writes batch_id, index, custom_id)") from e
