"""The worker loop: an RQ 3 worker that feeds a continuous batch instead of running one job.

It runs in-process (no fork: forking after MLX starts crashes on macOS). Each pass of the
loop collects finished jobs from the MLX thread and finishes them through RQ's own success
and failure handling, pulls as many jobs as there are free slots (registering each as an
RQ execution), and keeps every in-flight execution's heartbeat alive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import redis
from rq.exceptions import DeserializationError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus

from mlxq import keys
from mlxq.engine import Completion, EngineJob, JobInputError
from mlxq.runner import Runner, Work
from mlxq.serializer import serializer
from mlxq.types import JobMeta, Request, Result, Timing, Usage

log = logging.getLogger("mlxq.worker")

# While jobs run, how long each pass waits for the MLX thread to finish one.
BUSY_WAIT_S = 0.02
# After an empty non-blocking pull, wait this long before asking Redis again.
EMPTY_PULL_BACKOFF_S = 0.25
# Blocking pull timeout when idle: short, so stop requests are seen promptly.
IDLE_PULL_TIMEOUT_S = 1


class JobRejected(Exception):
    """A job this worker will not run (not an mlxq job, or an invalid request)."""


@dataclass
class InFlight:
    """A job this worker holds: registered with RQ and handed to the MLX thread."""

    job: Job
    queue: Queue
    execution: Execution
    request: Request
    meta: JobMeta
    started_at: float


class MlxqWorker(BaseWorker):
    """RQ worker that drains its queues into a continuous-batching MLX runner."""

    def __init__(
        self,
        queues: list[str],
        *,
        connection: redis.Redis,
        runner: Runner,
        model_name: str,
        name: str | None = None,
        heartbeat_interval: int = 15,
        grace_period: float = 60.0,
        maintenance_interval: int = 30,
    ) -> None:
        super().__init__(
            queues,
            name=name,
            connection=connection,
            serializer=serializer,
            default_result_ttl=keys.DEFAULT_RESULT_TTL,
            job_monitoring_interval=heartbeat_interval,
            maintenance_interval=maintenance_interval,
            log_job_description=False,
        )
        self.runner = runner
        self.model_name = model_name
        self.grace_period = grace_period
        self.inflight: dict[str, InFlight] = {}
        self._force_stop = False
        self._next_pull_at = 0.0
        self._last_beat = 0.0
        self.jobs_done = 0
        # Called with each finished job's generated-token count (progress bars).
        self.on_finish: Callable[[int], None] | None = None

    # -- signals: never raise from a handler; the loop reads the flags -----------------
    def _shutdown(self) -> None:
        self._stop_requested = True
        self.log.info(
            "Worker %s: stopping: finishing %d in-flight jobs", self.name, len(self.inflight)
        )

    def request_force_stop(self, signum, frame) -> None:
        self._force_stop = True

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Start one job (RQ's hook; the batch loop starts jobs in groups)."""
        self._start_group([(job, queue)])

    # -- the loop ------------------------------------------------------------------------
    def work(  # type: ignore[override]
        self, burst: bool = False, logging_level: str = "INFO", max_jobs: int | None = None
    ) -> bool:
        """Serve the queues until stopped (or, with ``burst``, until they are empty)."""
        self.bootstrap(logging_level)
        self._install_signal_handlers()
        self.set_state(WorkerStatus.IDLE)
        try:
            while not (self._stop_requested or self._force_stop):
                self.check_for_suspension(burst)
                if self.should_run_maintenance_tasks:
                    self.run_maintenance_tasks()
                self._finish(self.runner.completions())
                if max_jobs is not None and self.jobs_done >= max_jobs and not self.inflight:
                    break
                pulled = self._pull(block=not self.inflight and not burst)
                if burst and not pulled and not self.inflight:
                    self.log.info("Worker %s: queues empty, nothing in flight: done", self.name)
                    break
                self._beat_if_due()
                if self.inflight:
                    self._finish(self.runner.completions(timeout=BUSY_WAIT_S))
                if not self.runner.alive:
                    raise RuntimeError("the MLX thread died; see the log above")
            self._wind_down()
        finally:
            self._requeue_all()
            self.runner.stop()
            self.teardown()
        return self.jobs_done > 0

    def _pull(self, block: bool) -> int:
        """Dequeue up to the scheduler's free slots, in groups; returns how many started.

        Jobs reach the MLX thread a group at a time (one prefill batch), so they are
        prefilled together rather than one prompt per step as they trickle in.
        """
        scheduler = self.runner.scheduler
        assert scheduler is not None
        want = scheduler.fetch_count(len(self.inflight))
        if want <= 0 or (not block and time.monotonic() < self._next_pull_at):
            return 0
        found = self._dequeue(IDLE_PULL_TIMEOUT_S) if block else None
        group = [found] if found else []
        started = 0
        while True:
            group += self._dequeue_many(min(scheduler.prefetch, want - started) - len(group))
            if not group:
                break
            self._start_group(group)
            started += len(group)
            if started >= want:
                break
            group = []
        if started < want:
            self._next_pull_at = time.monotonic() + EMPTY_PULL_BACKOFF_S
        return started

    def _dequeue(self, timeout: int) -> tuple[Job, Queue] | None:
        """Wait up to ``timeout`` seconds for one job (RQ's blocking dequeue)."""
        try:
            return self.queue_class.dequeue_any(
                self._ordered_queues,
                timeout,
                connection=self.connection,
                job_class=self.job_class,
                serializer=self.serializer,
            )
        except Exception as e:  # DequeueTimeout, or a job hash that cannot be read
            if type(e).__name__ != "DequeueTimeout":
                self.log.error("Worker %s: could not dequeue: %s", self.name, e)
            return None

    def _dequeue_many(self, n: int) -> list[tuple[Job, Queue]]:
        """Up to ``n`` jobs without blocking, in queue order, in a few round trips.

        Ids move to RQ's intermediate queue (as RQ's own LMOVE dequeue does) until the
        job is registered, so a crash in between loses nothing.
        """
        out: list[tuple[Job, Queue]] = []
        for queue in self._ordered_queues:
            if len(out) >= n:
                break
            with self.connection.pipeline(transaction=False) as pipe:
                for _ in range(n - len(out)):
                    pipe.lmove(queue.key, queue.intermediate_queue_key)
                ids = [i.decode() for i in pipe.execute() if i is not None]
            if not ids:
                continue
            jobs = self.job_class.fetch_many(ids, self.connection, serializer=self.serializer)
            for job_id, job in zip(ids, jobs, strict=True):
                if job is None:  # deleted while queued: drop its id
                    self.connection.lrem(queue.intermediate_queue_key, 1, job_id)
                else:
                    out.append((job, queue))
        return out

    def _start_group(self, group: list[tuple[Job, Queue]]) -> None:
        """Register jobs as RQ executions, vet them, and hand the good ones over together."""
        executions = self._register(group)
        works = []
        for (job, queue), execution in zip(group, executions, strict=True):
            try:
                request, tokens = self._vet(job)
            except (JobRejected, JobInputError) as e:
                self._fail(job, queue, execution, str(e))
                continue
            meta = msgspec.convert(job.meta or {}, JobMeta)
            self.inflight[job.id] = InFlight(job, queue, execution, request, meta, time.time())
            works.append(Work(EngineJob(job.id, request), tokens))
        if works:
            self.runner.submit(works)

    def _vet(self, job: Job) -> tuple[Request, list[int]]:
        """The job's request and prompt tokens, or JobRejected/JobInputError saying why not."""
        request = decode_job(job)
        engine, scheduler = self.runner.engine, self.runner.scheduler
        assert engine is not None and scheduler is not None
        tokens = engine.encode(request)
        problem = scheduler.fits_alone(len(tokens), request.max_tokens)
        if problem:
            raise JobRejected(problem)
        return request, tokens

    def _register(self, group: list[tuple[Job, Queue]]) -> list[Execution]:
        """RQ's prepare_execution + prepare_job_execution for many jobs, in one round trip.

        (RQ's own version also reads ``job.func_name`` for the process title, which would
        deserialize a hostile payload before we have vetted it.)
        """
        executions = []
        with self.connection.pipeline() as pipe:
            self.set_state(WorkerStatus.BUSY, pipeline=pipe)
            for job, queue in group:
                ttl = self.get_heartbeat_ttl(job)
                execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
                self.executions[execution.id] = execution
                executions.append(execution)
                job.heartbeat(now(), ttl, pipeline=pipe)
                job.prepare_for_execution(self.name, pipeline=pipe)
                pipe.persist(job.key)
                pipe.lrem(queue.intermediate_queue_key, 1, job.id)
            self.heartbeat(self.job_monitoring_interval + 60, pipeline=pipe)
            pipe.execute()
        return executions

    def _finish(self, completions: list[Completion]) -> None:
        for c in completions:
            inf = self.inflight.pop(c.key, None)
            if inf is None:
                continue
            self.jobs_done += 1
            if self.on_finish is not None:
                self.on_finish(len(c.token_ids))
            if c.finish_reason == "error":
                self._fail(inf.job, inf.queue, inf.execution, c.error or "generation failed")
            else:
                result = build_result(inf, c, self.model_name, self.name)
                self._finalize_success(
                    inf.job, inf.queue, inf.execution, msgspec.to_builtins(result)
                )
        if not self.inflight and self.get_state() == WorkerStatus.BUSY:
            self.set_state(WorkerStatus.IDLE)

    def _fail(self, job: Job, queue: Queue, execution: Execution, message: str) -> None:
        """Fail one job through RQ (failed registry, retries); the others carry on."""
        self.log.warning("Worker %s: job %s failed: %s", self.name, job.id, message)
        job.ended_at = now()
        job._status = JobStatus.FAILED
        self.handle_job_failure(job, queue, exc_string=message, execution=execution)

    def _beat_if_due(self) -> None:
        """Refresh the worker's and every in-flight execution's heartbeat in one round trip."""
        if time.monotonic() - self._last_beat < self.job_monitoring_interval / 2:
            return
        self._last_beat = time.monotonic()
        with self.connection.pipeline() as pipe:
            self.heartbeat(self.job_monitoring_interval + 60, pipeline=pipe)
            stamp = now()
            for inf in self.inflight.values():
                ttl = self.get_heartbeat_ttl(inf.job)
                inf.execution.heartbeat(inf.job.started_job_registry, ttl, pipeline=pipe)
                inf.job.heartbeat(stamp, ttl, pipeline=pipe, xx=True)
            pipe.execute()

    # -- stopping ------------------------------------------------------------------------
    def _wind_down(self) -> None:
        """Finish in-flight jobs within the grace period (a second signal cuts it short)."""
        deadline = time.monotonic() + self.grace_period
        while self.inflight and not self._force_stop and time.monotonic() < deadline:
            self._finish(self.runner.completions(timeout=0.1))
            self._beat_if_due()

    def _requeue_all(self) -> None:
        """Put every job still held back at the front of its queue for another worker."""
        for key, inf in list(self.inflight.items()):
            self.runner.cancel(key)
            try:
                with self.connection.pipeline() as pipe:
                    self.cleanup_execution(inf.job, pipeline=pipe, execution=inf.execution)
                    inf.job.set_status(JobStatus.QUEUED, pipeline=pipe)
                    pipe.lpush(inf.queue.key, inf.job.id)
                    pipe.execute()
                self.log.info("Worker %s: put job %s back on %s", self.name, key, inf.queue.name)
            except redis.RedisError as e:
                self.log.error(
                    "Worker %s: could not requeue %s (%s); RQ's registry cleanup will recover it",
                    self.name,
                    key,
                    e,
                )
            del self.inflight[key]


def decode_job(job: Job) -> Request:
    """The job's request, refusing anything that is not a valid mlxq job."""
    try:
        func, instance, args, kwargs = job.func_name, job.instance, job.args, job.kwargs
    except DeserializationError as e:
        raise JobRejected(
            "job payload is not mlxq JSON; refusing it without deserializing "
            "(mlxq never loads pickle). Submit with `mlxq submit` or the mlxq client"
        ) from e
    if func != keys.JOB_FUNC or instance is not None or kwargs or len(args) != 1:
        raise JobRejected(f"job calls {func!r}; mlxq workers only run {keys.JOB_FUNC}(request)")
    try:
        return msgspec.convert(args[0], Request)
    except msgspec.ValidationError as e:
        raise JobRejected(f"invalid request: {e}") from e


def build_result(inf: InFlight, c: Completion, model: str, worker: str) -> Result:
    """The stored result of a finished job: tokens, usage and timing."""
    n = len(c.token_ids)
    return Result(
        job_id=inf.job.id,
        custom_id=inf.request.custom_id or inf.meta.custom_id,
        finish_reason=c.finish_reason,
        text=c.text,
        token_ids=c.token_ids,
        usage=Usage(c.prompt_tokens, n, c.prompt_tokens + n),
        logprobs=c.logprobs,
        model=model,
        worker=worker,
        batch_id=inf.meta.batch_id,
        index=inf.meta.index,
        metadata=inf.request.metadata,
        timing=_timing(inf, c),
    )


def _timing(inf: InFlight, c: Completion) -> Timing:
    enqueued = inf.job.enqueued_at.timestamp() if inf.job.enqueued_at else None
    n = len(c.token_ids)
    return Timing(
        enqueued_at=enqueued,
        started_at=inf.started_at,
        first_token_at=c.first_token_at,
        finished_at=c.finished_at,
        queue_wait_s=_diff(inf.started_at, enqueued),
        ttft_s=_diff(c.first_token_at, inf.started_at),
        prefill_tps=_rate(c.prompt_tokens, c.prefill_seconds),
        decode_tps=_rate(n - 1, c.decode_seconds),
    )


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else max(0.0, end - start)


def _rate(count: int, seconds: float | None) -> float | None:
    return count / seconds if seconds and count > 0 else None
