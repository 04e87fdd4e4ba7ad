"""Vetting pulled jobs before the engine gets them: a valid mlxq request that this worker
can run (the model it names is the one loaded, its prompt tokenizes and its KV cache fits),
and whether its batch expired.

A job reaches a queue by any path (`mlxq submit` routes each line to its model's queue, but
a producer writing RQ jobs or the Redis layout directly may not), so the model a job names
is checked here: never run on another model without a word.

Nothing here writes to Redis: a refused job is failed through RQ by the worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
from rq.job import Job

from mlxq.broker.intake import JobRejected, decode_job
from mlxq.broker.routing import same_model
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
class Elsewhere:
    """A job naming another model this worker serves: it goes to that model's queue (which
    this worker also serves: it switches to the model when its turn comes)."""

    queue: str


@dataclass(frozen=True)
class Served:
    """The models a worker serves: the one loaded, and each one's own queue."""

    active: str
    own_queues: dict[str, str]  # model -> its own queue

    def check(self, named: str | None, queue: str) -> Refused | Elsewhere | None:
        """Whether a job naming model ``named``, pulled from ``queue``, runs here (None),
        goes to the queue of another model this worker serves, or is refused."""
        if named is None or same_model(named, self.active):
            return None
        for model, own in self.own_queues.items():
            if same_model(named, model) and own != queue:
                return Elsewhere(own)
        served = ", ".join(repr(m) for m in self.own_queues)
        return Refused(
            f"this job names model {named!r}, but it was put on queue {queue!r}, whose worker "
            f"serves {served}: not run on another model. Enqueue it where a worker of "
            f"{named!r} listens (`mlxq submit` routes each line to its model's queue), or "
            "leave out `model` to run on whichever model serves the queue"
        )


@dataclass
class Vetted:
    """A job that passed vetting: what the engine runs, unless its batch expired."""

    request: Request
    tokens: list[int]
    meta: JobMeta
    expired: bool


def vet(runner: Runner, job: Job, served: Served, queue: str) -> Vetted | Refused | Elsewhere:
    """The job, ready for the engine, or why it cannot run here (a one-line error, or the
    queue of the model it names)."""
    tokens: list[int] = []
    try:
        request = decode_job(job)
        meta = _meta(job)
        other = served.check(request.model, queue)
        if other is not None:
            return other
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
