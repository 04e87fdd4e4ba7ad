"""The worker loop: an RQ 3 worker that feeds a continuous batch instead of running one job.

It runs in-process (no fork: forking after MLX starts crashes on macOS). Each pass of the
loop (:meth:`MlxqWorker._pass`) writes back what the MLX thread finished (many jobs per
Redis round trip, ``writeback``), heartbeats the jobs it holds and sweeps its queues for
jobs others left behind, pulls as many jobs as there are free slots (vetted, handed to the
MLX thread, registered as RQ executions), and checks cancels, time limits and a hung MLX
thread (``watchdog``). Redis outages are ridden out with backoff: the MLX thread keeps
generating meanwhile and results are written once Redis is back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import redis
from rq.job import Job
from rq.queue import Queue
from rq.worker import WorkerStatus

from mlxq.broker import fleet, intake
from mlxq.broker.keys import queue_name_for_model
from mlxq.broker.recovery import sweep
from mlxq.broker.rq_store import internals
from mlxq.broker.rq_store.job_loading import Unreadable
from mlxq.broker.rq_store.worker_base import RQWorkerBase
from mlxq.engine.runner import Runner, Work
from mlxq.engine.sampling import Completion, EngineJob
from mlxq.wire import Result
from mlxq.worker import sharing
from mlxq.worker.keep_awake import KeepAwake
from mlxq.worker.outage import WRITE_REFUSALS, Outage, ServerWatch, refuses_writes, while_refused
from mlxq.worker.outcomes import InFlight, build_result
from mlxq.worker.profile import DEFAULTS, STALL_TIMEOUT_S
from mlxq.worker.reporting import Reporter
from mlxq.worker.stopping import release, release_all
from mlxq.worker.vetting import Served, Vetted, vet
from mlxq.worker.watchdog import EngineDied, EngineStalled, Watchdog, record_stall
from mlxq.worker.writeback import (
    MAX_RESULT_BYTES,
    ResultLimit,
    Writeback,
    result_limit,
    taken_over,
)

if TYPE_CHECKING:
    from mlxq.worker.switching import ModelSwitcher

log = logging.getLogger("mlxq.worker")

BUSY_WAIT_S = 0.02  # while jobs run, how long a pass waits for the MLX thread
EMPTY_PULL_BACKOFF_S = 0.25  # after an empty pull, wait before asking Redis again
IDLE_PULL_TIMEOUT_S = 1  # blocking pull when idle: short, so stop requests are seen
RECOVERY_INTERVAL_S = 5.0  # how often abandoned jobs of dead workers are looked for


class MlxqWorker(RQWorkerBase):
    """RQ worker that drains its queues into a continuous-batching MLX runner."""

    def __init__(
        self,
        queues: list[str],
        *,
        connection: redis.Redis,
        runner: Runner,
        model_name: str,
        name: str | None = None,
        abandon_after: int = DEFAULTS.abandon_after,
        max_job_bytes: int = DEFAULTS.max_job_bytes,
        grace_period: float = DEFAULTS.grace_period,
        stall_timeout: float = STALL_TIMEOUT_S["metal"],
        max_result_bytes: int = MAX_RESULT_BYTES,
        keep_awake: bool = DEFAULTS.keep_awake,
    ) -> None:
        super().__init__(queues, connection=connection, name=name, abandon_after=abandon_after)
        self.max_job_bytes = max_job_bytes
        self.runner = runner
        self.model_name = model_name
        self.grace_period = grace_period
        self.stall_timeout = stall_timeout
        self.stalled = False
        self.watchdog = Watchdog(self, runner, abandon_after, stall_timeout)
        self.keep_awake = KeepAwake.for_worker(keep_awake, self.name)  # macOS: no idle sleep
        self.inflight: dict[str, InFlight] = {}
        # Ended jobs (and stream output) not yet written to Redis; results over the tightest
        # of max_result_bytes and the server's limits fail their job instead.
        self.max_result_bytes = max_result_bytes
        self.owed = Writeback(ResultLimit(max_result_bytes))
        self.server_watch = ServerWatch(self.log, self.name)  # evicting policy: intake paused
        self.jobs_done = 0
        self.reporter: Reporter | None = None  # set by the launcher: fleet info, metrics
        self.switcher: ModelSwitcher | None = None  # set by the launcher: several models
        # Called with each finished job's Result (progress bars, metrics).
        self.on_finish: Callable[[Result], None] | None = None
        self._next_pull_at = self._last_sweep = 0.0

    # -- signals: never raise from a handler; the loop reads the flags -----------------
    def _shutdown(self) -> None:
        internals.request_stop(self)
        self.log.info("Worker %s: stopping, finishing %d jobs", self.name, len(self.inflight))

    def request_stop_execution(self, execution_id: str) -> None:
        """RQ's `stop-job` command (pubsub thread): stop that job at the next step."""
        for inf in list(self.inflight.values()):
            if inf.execution.id == execution_id:
                inf.stop_reason = "cancelled"
                self.runner.cancel(inf.job.id)

    def execute_job(self, job: Job, queue: Queue) -> None:
        """Start one job (RQ's hook; the batch loop starts jobs in groups)."""
        self._start_group([(job, queue)])

    # -- the loop ------------------------------------------------------------------------
    def work(  # type: ignore[override]
        self, burst: bool = False, logging_level: str = "INFO", max_jobs: int | None = None
    ) -> bool:
        """Serve the queues until stopped (or, with ``burst``, until they are empty)."""
        outage = Outage(self.log, self.name)
        try:
            # Handlers first: a signal during bootstrap stops the loop like a later one (a
            # KeyboardInterrupt there could leave RQ's command-channel thread running).
            internals.install_signal_handlers(self)
            while_refused(lambda: self.bootstrap(logging_level), outage)  # a full Redis: wait
            self.set_state(WorkerStatus.IDLE)
            with contextlib.suppress(redis.RedisError):  # (its loop publishes it again)
                self._report_if_due(force=True)  # seen by `mlxq api` as soon as it listens
            while not (internals.stop_requested(self) or self.force_stop):
                try:
                    self._check_server_if_due()
                    done = self._pass(burst, max_jobs)
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    time.sleep(outage.lost(e, len(self.owed)))
                    self.watchdog.beat_soon()  # back from an outage: heartbeat first thing
                    continue
                except redis.ResponseError as e:
                    if not refuses_writes(e):
                        raise
                    time.sleep(outage.refused(e, len(self.owed)))  # full: hold, take nothing
                    self.watchdog.beat_soon()
                    continue
                outage.passed()
                self._rest_while_paused()
                if done:
                    break
            self._wind_down()
        except EngineStalled as e:
            self._on_stall(e)
            raise
        finally:
            self.keep_awake.release()
            release_all(self, self.inflight, self.runner, self.owed, self.reporter)
            if not self.stalled:  # a hung MLX thread never joins: do not wait for it
                self.runner.stop()
                self._forget()
            self.teardown_quietly()
        return self.jobs_done > 0

    def _pass(self, burst: bool, max_jobs: int | None) -> bool:
        """One pass of the loop; True when the worker is done."""
        self.check_for_suspension(burst)
        self.watchdog.woke(self.inflight)
        # Results and heartbeats before the sweep: after an outage the sweep would otherwise
        # find this worker's own jobs lapsed and put them back.
        self._finish(self.runner.completions())
        self._beat_if_due()
        self._maintain()
        busy = bool(self.inflight or self.owed)
        if max_jobs is not None and self.jobs_done >= max_jobs and not busy:
            return True
        # A worker of several models takes no jobs while it switches (``switching``).
        holding = self.switcher is not None and self.switcher.holding(self)
        closed = self.intake_paused or holding
        pulled = 0 if closed else self._pull(block=not busy and not burst)
        self.keep_awake.set(bool(self.inflight or self.owed))  # (acts only on a change)
        if burst and not pulled and not self.inflight and not closed:
            self.log.info("Worker %s: queues empty, nothing in flight: done", self.name)
            return True
        self._report_if_due()
        self.watchdog.control_if_due(self.inflight)
        if self.inflight:
            self._finish(self.runner.completions(timeout=BUSY_WAIT_S))
        if not self.runner.alive:
            raise EngineDied("the MLX thread stopped on an error (logged above)")
        if self.watchdog.woke(self.inflight):
            self._beat_if_due()  # (before the stall check: what it holds is checked first)
        self.watchdog.check_stall(self.inflight)
        return False

    # -- a hung MLX thread ---------------------------------------------------------------
    def _on_stall(self, e: EngineStalled) -> None:
        """Log it, stop heartbeating, and leave a ``stalled`` record for `mlxq workers`."""
        self.stalled = True
        self.log.error("Worker %s: %s", self.name, e)
        if self.reporter is not None:
            record_stall(
                self.reporter, self.connection, self.runner, self.inflight, self.abandon_after
            )

    # -- taking jobs ---------------------------------------------------------------------
    def _maintain(self) -> None:
        # Swept right before RQ's own maintenance too: RQ would fail abandoned jobs
        # (bypassing the batch counters) where mlxq puts them back.
        maintenance = self.should_run_maintenance_tasks
        if maintenance or time.monotonic() - self._last_sweep >= RECOVERY_INTERVAL_S:
            self._last_sweep = time.monotonic()
            self._sweep()
        if maintenance:
            self.run_maintenance_tasks()

    def _sweep(self) -> None:
        """Put back what dead workers, stranded pulls or unknown paths left on this
        worker's queues (``recovery.sweep``); count it by how."""
        swept = sweep(self.queues, self.abandon_after, RECOVERY_INTERVAL_S)
        if self.reporter is not None:
            for how, job_ids in swept.items():
                self.reporter.recovered(how, job_ids)

    def _pull(self, block: bool) -> int:
        """Dequeue up to the scheduler's free slots in one go; returns how many were taken.

        The jobs reach the MLX thread together, so they are prefilled in full batches
        rather than one prompt per step as they would trickle in one by one. Every pull
        moves ids into RQ's intermediate lists (``intake``), so none is ever out of a list
        that recovery sweeps, however many queues the worker serves.
        """
        scheduler = self.runner.scheduler
        assert scheduler is not None
        want = scheduler.fetch_count(len(self.inflight))
        # The backoff spares Redis while busy; an idle worker always looks (burst exits
        # on an empty look, so it must be a real one).
        if want <= 0 or (self.inflight and time.monotonic() < self._next_pull_at):
            return 0
        pulled = intake.wait_for_job(self, IDLE_PULL_TIMEOUT_S, self.max_job_bytes) if block else []
        pulled += intake.dequeue_many(self, want - len(pulled), self.max_job_bytes)
        unreadable = [p for p in pulled if isinstance(p, Unreadable)]
        group = [p for p in pulled if not isinstance(p, Unreadable)]
        if unreadable:
            intake.fail_unreadable(self, unreadable)
            if self.reporter is not None:
                for _ in unreadable:
                    self.reporter.failed("rejected")
        if group:
            self._start_group(group)
        if len(pulled) < want:
            self._next_pull_at = time.monotonic() + EMPTY_PULL_BACKOFF_S
        return len(pulled)

    def _served(self) -> Served:
        """The models this worker serves, the loaded one first (what vetting checks)."""
        if self.switcher is None:
            return Served(self.model_name, {self.model_name: queue_name_for_model(self.model_name)})
        own = {m: queue_name_for_model(m) for m in self.switcher.queues}
        return Served(self.switcher.active, own)

    def _start_group(self, group: list[tuple[Job, Queue]]) -> None:
        """Vet jobs, hand the good ones to the engine together, then register them all as
        RQ executions: the engine starts on them meanwhile, and nothing is written back
        before they are registered (that happens on this thread)."""
        served = self._served()
        vetted = [vet(self.runner, job, served, queue.name) for job, queue in group]
        works = [
            Work(EngineJob(job.id, v.request), v.tokens)
            for (job, _), v in zip(group, vetted, strict=True)
            if isinstance(v, Vetted) and not v.expired
        ]
        handed = time.time()  # the jobs' start: the engine may finish a short one before
        if works:  # they are registered below
            self.runner.submit(works)
        try:
            executions = intake.register(self, group)
        except redis.RedisError:
            # Unregistered, the jobs stay in RQ's intermediate queue for the sweep.
            for w in works:
                self.runner.cancel(w.job.key)
            raise
        # Every outcome is owed before any is written: a Redis error midway loses none.
        for (job, queue), execution, v in zip(group, executions, vetted, strict=True):
            if isinstance(execution, str):
                self.runner.cancel(job.id)
                self.log.warning("Worker %s: job %s %s", self.name, job.id, execution)
                continue
            held = InFlight.of(job, queue, execution, v, handed) if isinstance(v, Vetted) else None
            if held is not None and not v.expired:
                self.inflight[job.id] = held
            else:
                self.owed.owe_unrun(job, queue, execution, v, held, self.model_name, self.name)
        self._flush()

    # -- finishing jobs ------------------------------------------------------------------
    def _finish(self, completions: list[Completion]) -> None:
        """Take what the MLX thread finished, then write back everything owed: stream
        output, results in one transaction, failures through RQ."""
        self._take(completions)
        self._flush()
        if not self.inflight and self.get_state() == WorkerStatus.BUSY:
            self.set_state(WorkerStatus.IDLE)
        if completions and not self.inflight:
            # Publish the emptied batch now: an idle worker next blocks on its queues, and
            # readers would see the last running batch until that returns.
            self._report_if_due(force=True)

    def _take(self, completions: list[Completion]) -> None:
        """Move finished jobs from in flight to owed, with their results (no Redis here)."""
        tokenizer = getattr(self.runner.engine, "tokenizer", None)  # logprobs' bytes

        def result_of(inf: InFlight, c: Completion) -> Result:
            return build_result(inf, c, self.model_name, self.name, tokenizer)

        self.owed.chunks += self.runner.stream_chunks()
        for result in self.owed.take(completions, self.inflight, result_of):
            self.jobs_done += 1
            if self.on_finish is not None:
                self.on_finish(result)
            if self.reporter is not None:
                self.reporter.finished(result)

    def _flush(self) -> None:
        """Write back everything owed (:class:`~mlxq.worker.writeback.Writeback`)."""
        self.owed.flush(self, self.reporter)

    # -- heartbeats, cancels and time limits ---------------------------------------------
    def _beat_if_due(self) -> None:
        """Heartbeats when due; jobs found handed to another worker are dropped (said in
        one line)."""
        taken_over(self, self.reporter, self.watchdog.beat_if_due(self.inflight))

    def _report_if_due(self, force: bool = False) -> None:
        """Publish this worker's state (`mlxq workers`, progress bars, metrics) when due
        (``Reporter.publish_if_due``), or now with ``force``."""
        if self.reporter is not None and self.runner.scheduler is not None:
            self.reporter.publish_if_due(
                self.connection,
                self.runner.scheduler,
                len(self.inflight),
                ttl=self.abandon_after,
                memory=self.runner.memory,
                state=self._published_state(),
                step_age_s=self.watchdog.step_age(self.inflight),
                force=force,
            )

    def _published_state(self) -> str:
        """The state published: paused (Redis may evict), switching models, or running."""
        if self.intake_paused:
            return "paused"
        return "switching" if self.switcher is not None and self.switcher.busy else "running"

    # -- what the model switcher asks (``switching.Host``) ------------------------------
    @property
    def jobs_held(self) -> int:
        """Jobs in flight or with results still owed to Redis."""
        return len(self.inflight) + len(self.owed)

    def pull_only(self, queues: Sequence[str]) -> None:
        """Take jobs only from these of its queues (a worker of several models pulls for
        the loaded one); it still serves, sweeps and lists them all."""
        internals.pull_only(self, queues)

    # -- stopping ------------------------------------------------------------------------
    def _wind_down(self) -> None:
        """Finish the running jobs within the grace period (a second signal cuts it short);
        jobs pulled but not yet in the batch go back on their queues at once."""
        release(self, self.inflight, self.runner.withdraw_pending(), self.runner, self.reporter)
        deadline = time.monotonic() + self.grace_period
        while (self.inflight or self.owed) and not self.force_stop and time.monotonic() < deadline:
            try:
                self._finish(self.runner.completions(timeout=0.1))
                self._beat_if_due()
            except (redis.ConnectionError, redis.TimeoutError, *WRITE_REFUSALS):
                time.sleep(0.5)

    def _forget(self) -> None:
        """Drop this worker's record (`mlxq workers`) and memory claim on a clean exit."""
        try:
            fleet.remove(self.connection, self.name)
            sharing.release_claim(self.connection)
        except redis.RedisError:
            pass  # it expires by itself

    # -- the server under a running worker (``outage.ServerWatch``) ---------------------
    @property
    def intake_paused(self) -> bool:
        """True while this worker takes no new jobs because Redis may evict keys (its
        ``maxmemory-policy`` is not ``noeviction``, as read every ``CHECK_INTERVAL_S``);
        jobs in flight still finish and are written."""
        return self.server_watch.paused

    def _check_server_if_due(self) -> None:
        """Read the server's policy and limits when due (pausing intake on an evicting
        policy) and fit the largest result written to them."""
        if self.server_watch.check_if_due(self.connection):
            self.owed.limit = result_limit(self.max_result_bytes, self.server_watch.limits)

    def _rest_while_paused(self) -> None:
        """An idle worker with its intake paused waits here instead of a blocking pull."""
        if self.intake_paused and not self.inflight and not self.owed:
            time.sleep(IDLE_PULL_TIMEOUT_S)
