"""What a worker owes Redis: stream output and ended jobs that are not written yet.

The MLX thread hands over finished jobs once; if Redis goes away mid-write they must not
be dropped (the engine has let go of them, and nothing else would ever end them). They wait
here, in order, and the next pass writes them once Redis is back; while Redis refuses every
write (full, read-only) they wait too. A result Redis cannot take (larger than it accepts,
or refused for that job alone) fails its own job with an error result that fits, and never
holds up the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.utils import now
from rq.worker import BaseWorker

from mlxq.broker import streams
from mlxq.broker.eviction import ServerLimits
from mlxq.broker.rq_store import end_script, ownership, transitions
from mlxq.broker.rq_store.ownership import Held
from mlxq.engine.sampling import Completion
from mlxq.wire import Result, StreamChunk, json_encoder
from mlxq.worker.outage import refuses_writes
from mlxq.worker.outcomes import InFlight, unrun_result
from mlxq.worker.profile import DEFAULTS
from mlxq.worker.reporting import Reporter
from mlxq.worker.vetting import Elsewhere, Refused, Vetted

MAX_RESULT_BYTES = DEFAULTS.max_result_bytes  # the default cap on one stored result
MIN_BULK_LEN = 1024 * 1024  # Redis's smallest proto-max-bulk-len


@dataclass
class Failure:
    """A registered job to fail (or retry) through RQ: a generation error, or a job refused
    at vetting (``reason`` is its category for the worker's counters). ``retry`` False ends
    it at once: running it again would only make the same result."""

    job: Job
    queue: Queue
    execution: Execution
    result: Result
    reason: str = "error"
    retry: bool = True


@dataclass
class Redirect:
    """A registered job naming another model this worker serves: it goes to ``to``, that
    model's queue (vetting's ``Elsewhere``)."""

    job: Job
    queue: Queue
    execution: Execution
    to: str


@dataclass(frozen=True)
class ResultLimit:
    """The largest result a worker writes, in bytes as stored, and which limit sets it."""

    max_bytes: int = MAX_RESULT_BYTES
    source: str = "the worker's max result size"


def result_limit(setting: int, server: ServerLimits | None) -> ResultLimit:
    """The tightest of the worker's own cap and what the server takes: one command's value
    (``proto-max-bulk-len``; more drops the connection) and a quarter of ``maxmemory``."""
    limits = [ResultLimit(setting)]
    if server is not None:
        bulk = server.proto_max_bulk_len
        limits.append(ResultLimit(bulk, f"Redis's proto-max-bulk-len of {bulk:,} bytes"))
        if server.maxmemory:  # (never below the smallest bulk limit Redis allows)
            quarter = max(server.maxmemory // 4, MIN_BULK_LEN)
            limits.append(ResultLimit(quarter, f"a quarter of Redis's maxmemory ({quarter:,})"))
    return min(limits, key=lambda limit: limit.max_bytes)


def stored_size(result: Result) -> int:
    """Bytes of a result as Redis stores it (RQ's base64 of its JSON)."""
    return 4 * -(-len(json_encoder.encode(result)) // 3)


def refused_result(result: Result, why: str) -> Result:
    """``result`` as a failure that fits: usage, timing and ids kept, the output dropped."""
    return msgspec.structs.replace(
        result, finish_reason="error", text="", token_ids=[], logprobs=None, error=why
    )


def too_large(size: int, limit: str) -> str:
    """The error of a result Redis cannot take, and what to change."""
    return (
        f"result of {size:,} bytes too large for Redis ({limit}); "
        "lower max_tokens or logprobs, or raise the limit"
    )


class Writeback:
    """Stream chunks, stream end markers, failures and results waiting to be written."""

    def __init__(self, limit: ResultLimit | None = None) -> None:
        self.chunks: list[StreamChunk] = []
        self.stream_ends: list[tuple[str, str]] = []  # (job id, finish reason)
        self.failed: list[Failure] = []
        self.done: list[tuple[InFlight, Result]] = []
        self.redirected: list[Redirect] = []
        self.limit = limit or ResultLimit()

    def __len__(self) -> int:
        """Ended jobs still owed."""
        return len(self.failed) + len(self.done) + len(self.redirected)

    def take(
        self,
        completions: list[Completion],
        inflight: dict[str, InFlight],
        result_of: Callable[[InFlight, Completion], Result],
    ) -> list[Result]:
        """Move the jobs the MLX thread finished out of ``inflight`` into what is owed, with
        their results (``result_of``; a failed generation becomes a failure to write); the
        results, in order. No Redis here."""
        taken = []
        for c in completions:
            inf = inflight.pop(c.key, None)
            if inf is None:
                continue
            if inf.request.stream:
                self.stream_ends.append((c.key, c.finish_reason))
            result = result_of(inf, c)
            taken.append(result)
            if c.finish_reason == "error":
                if result.error is None:
                    result = msgspec.structs.replace(result, error="generation failed")
                self.failed.append(Failure(inf.job, inf.queue, inf.execution, result))
            else:
                self.done.append((inf, result))
        return taken

    def owe_unrun(
        self,
        job: Job,
        queue: Queue,
        execution: Execution,
        v: Vetted | Refused | Elsewhere,
        held: InFlight | None,
        model: str,
        worker: str,
    ) -> None:
        """Owe the outcome of a registered job that will not run here: refused at vetting
        (a failure), naming another model this worker serves (moved to its queue), or
        whose batch expired (``held``: an ``expired`` result)."""
        if isinstance(v, Elsewhere):
            self.redirected.append(Redirect(job, queue, execution, v.queue))
        elif isinstance(v, Refused):
            result = transitions.result_without_output(
                job, "error", v.error, model=model, worker=worker, prompt_tokens=v.prompt_tokens
            )
            self.failed.append(Failure(job, queue, execution, result, "rejected"))
        elif held is not None:
            why = "the batch expired before this request ran"
            self.done.append((held, unrun_result(held, "expired", why, model, worker)))

    def flush(self, worker: BaseWorker, reporter: Reporter | None = None) -> None:
        """Write everything owed; the late results and failures of jobs found handed to
        another worker meanwhile are dropped (said in one line, :func:`taken_over`). A Redis
        error propagates, with what is left kept for the next try: a write that landed
        before its reply was lost is found not held, never redone.
        """
        if self.chunks or self.stream_ends:
            streams.publish(worker.connection, self.chunks, self.stream_ends)
            self.chunks, self.stream_ends = [], []
        self._refuse_oversized()
        lost: list[Held] = list(self._write_done(worker))
        while self.failed:
            if not _fail_one(worker, self.failed[0], reporter):
                lost.append(self.failed[0])
            self.failed.pop(0)  # done: a Redis error in a later one keeps the rest
        if self.redirected:
            moved = transitions.redirect(worker, self.redirected)
            for r, ok in zip(self.redirected, moved, strict=True):
                if ok:
                    worker.log.info(
                        "Worker %s: job %s names the model of queue %s: moved there",
                        worker.name,
                        r.job.id,
                        r.to,
                    )
            lost += [r for r, ok in zip(self.redirected, moved, strict=True) if not ok]
            self.redirected = []
        taken_over(worker, reporter, lost)

    def _refuse_oversized(self) -> None:
        """Fail, before any write, the results larger than the limit."""
        keep = []
        for inf, r in self.done:
            size = stored_size(r)
            if size <= self.limit.max_bytes:
                keep.append((inf, r))
                continue
            error = too_large(size, f"over {self.limit.source}")
            self._refuse(inf, r, error)
        self.done = keep

    def _refuse(self, inf: InFlight, result: Result, why: str) -> None:
        failure = Failure(
            inf.job, inf.queue, inf.execution, refused_result(result, why), "too_large", False
        )
        self.failed.append(failure)

    def _write_done(self, worker: BaseWorker) -> list[InFlight]:
        """Write the owed results: the lost jobs. Those Redis refuses for themselves become
        failures; while it refuses every write, they stay owed and its error propagates."""
        try:
            written = write_results(worker, self.done)
            self.done = []
        except redis.ConnectionError:
            if not _answers(worker.connection):
                raise  # Redis is away: everything stays owed
            # Redis is there but dropped the connection on this write (a value over its
            # proto-max-bulk-len does that): find the result it chokes on, one at a time.
            written = self._one_by_one(worker)
        for inf, r, e in written.refused:
            if refuses_writes(e):
                self.done.append((inf, r))
            elif "bulk length" in str(e):  # Redis's answer before it drops the connection
                self._refuse(inf, r, _over_bulk_limit(r))
            else:
                self._refuse(inf, r, f"Redis refused this job's result ({e})")
        if self.done:
            raise next(e for _, _, e in written.refused if refuses_writes(e))
        return written.lost

    def _one_by_one(self, worker: BaseWorker) -> Written:
        written = Written()
        while self.done:
            inf, r = self.done[0]
            try:
                written.add(write_results(worker, [(inf, r)]))
            except redis.ConnectionError:
                if not _answers(worker.connection):
                    raise
                self._refuse(inf, r, _over_bulk_limit(r))
            self.done.pop(0)
        return written


def _over_bulk_limit(result: Result) -> str:
    """The error of a result Redis dropped the connection on (its limit was not known)."""
    return too_large(stored_size(result), "over its proto-max-bulk-len")


def _fail_one(worker: BaseWorker, f: Failure, reporter: Reporter | None) -> bool:
    """Fail one job it still holds (retried if it has retries left, else ended with its
    error result); False where another worker had taken it. A job whose failure Redis
    refuses (but not a Redis that refuses all writes) is left to the sweep, which puts it
    back once its heartbeat lapses."""
    if not f.retry:
        f.job.retries_left = 0  # RQ reads it from the job object: not written back
    f.job.ended_at = now()
    try:
        if transitions.fail_or_retry(worker, f, f.result) is None:
            return False
    except redis.ResponseError as e:
        if refuses_writes(e):
            raise
        worker.log.error(
            "Worker %s: Redis refused to end job %s (%s); left for the sweep",
            worker.name,
            f.job.id,
            e,
        )
        return True
    worker.log.warning("Worker %s: job %s failed: %s", worker.name, f.job.id, f.result.error)
    if reporter is not None:
        reporter.failed(f.reason)
    return True


def taken_over(worker: BaseWorker, reporter: Reporter | None, lost: Sequence[Held]) -> None:
    """Say, in one line, that jobs this worker held were taken by another worker while it
    was away (stopped, asleep or cut off past ``--abandon-after``), and count them."""
    if not lost:
        return
    worker.log.warning(
        "Worker %s: %d of its jobs were taken back while it was away (stopped, asleep or "
        "cut off past --abandon-after) and handed on; left them to the other workers, so "
        "none runs twice (first: %s)",
        worker.name,
        len(lost),
        lost[0].job.id,
    )
    if reporter is not None:
        reporter.taken_over(len(lost))


def _answers(conn: redis.Redis) -> bool:
    """Whether Redis answers right now (after a write dropped the connection)."""
    try:
        return bool(conn.ping())
    except redis.ConnectionError:
        return False


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
