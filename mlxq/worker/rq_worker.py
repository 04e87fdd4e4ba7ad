"""The worker loop: an RQ 3 worker that feeds a continuous batch instead of running one job.

It runs in-process (no fork: forking after MLX starts crashes on macOS). Each pass of the
loop writes back jobs the MLX thread finished (many per Redis round trip), pulls as many
jobs as there are free slots (registering each as an RQ execution), and keeps every
in-flight execution's heartbeat alive (the checks on held jobs, and on a hung MLX thread,
are ``watchdog``'s). Redis outages are ridden out with backoff: the MLX thread keeps
generating meanwhile and results are written once Redis is back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import redis
from rq.job import Job
from rq.queue import Queue
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus

from mlxq.broker import fleet, keys
from mlxq.broker.rq_store import internals, transitions
from mlxq.broker.serializer import serializer
from mlxq.engine.runner import Runner
from mlxq.engine.sampling import Completion
from mlxq.wire import Result
from mlxq.worker import watchdog
from mlxq.worker.keep_awake import KeepAwake
from mlxq.worker.outage import WRITE_REFUSALS, Outage, ServerWatch, refuses_writes, while_refused
from mlxq.worker.outcomes import InFlight, build_result
from mlxq.worker.profile import DEFAULTS, STALL_TIMEOUT_S
from mlxq.worker.reporting import Reporter
from mlxq.worker.stopping import release, release_all, taken_over
from mlxq.worker.taking import IDLE_PULL_TIMEOUT_S, JobIntake
from mlxq.worker.watchdog import EngineDied, EngineStalled
from mlxq.worker.writeback import MAX_RESULT_BYTES, Failure, ResultLimit, Writeback, result_limit

if TYPE_CHECKING:
    from mlxq.worker.switching import ModelSwitcher

log = logging.getLogger("mlxq.worker")

BUSY_WAIT_S = 0.02  # while jobs run, how long a pass waits for the MLX thread
CONTROL_INTERVAL_S = 0.5  # how often cancel flags and time limits are checked
REPORT_INTERVAL_S = 2.0  # how often the worker publishes its state (WorkerInfo, metrics)


class MlxqWorker(JobIntake, BaseWorker):
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
        # Heartbeats every third of `abandon_after`: a job whose worker misses three is
        # put back on its queue by the other workers.
        super().__init__(
            queues,
            name=name,
            connection=connection,
            serializer=serializer,
            default_result_ttl=keys.DEFAULT_RESULT_TTL,
            job_monitoring_interval=max(1, abandon_after // 3),
            log_job_description=False,
        )
        self.abandon_after = abandon_after
        self.max_job_bytes = max_job_bytes
        self.runner = runner
        self.model_name = model_name
        self.grace_period = grace_period
        self.stall_timeout = stall_timeout
        self.stalled = False
        self.awake = watchdog.Awake()
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
        self._force_stop = False
        self._next_pull_at = self._last_beat = self._last_control = self._last_sweep = 0.0
        self._last_report = 0.0

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """Executions expire ``abandon_after`` seconds after the last heartbeat."""
        return self.abandon_after

    # -- signals: never raise from a handler; the loop reads the flags -----------------
    def _shutdown(self) -> None:
        internals.request_stop(self)
        self.log.info("Worker %s: stopping, finishing %d jobs", self.name, len(self.inflight))

    def request_force_stop(self, signum, frame) -> None:
        self._force_stop = True

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
        try:  # (a signal during bootstrap still ends in the teardown below)
            while_refused(lambda: self.bootstrap(logging_level), outage)  # a full Redis: wait
            internals.install_signal_handlers(self)
            self.set_state(WorkerStatus.IDLE)
            with contextlib.suppress(redis.RedisError):  # (its loop publishes it again)
                self._report_if_due(force=True)  # seen by `mlxq api` as soon as it listens
            while not (internals.stop_requested(self) or self._force_stop):
                try:
                    self._check_server_if_due()
                    done = self._pass(burst, max_jobs)
                except (redis.ConnectionError, redis.TimeoutError) as e:
                    time.sleep(outage.lost(e, len(self.owed)))
                    self._last_beat = 0.0  # back from an outage: heartbeat first thing
                    continue
                except redis.ResponseError as e:
                    if not refuses_writes(e):
                        raise
                    time.sleep(outage.refused(e, len(self.owed)))  # full: hold, take nothing
                    self._last_beat = 0.0
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
            self._teardown()
        return self.jobs_done > 0

    def _teardown(self) -> None:
        """RQ's teardown, each part on its own: a Redis away or full must not leave the
        command channel's thread running (it would log connection errors until exit)."""
        with contextlib.suppress(redis.RedisError):  # its record expires by itself
            self.register_death()
        with contextlib.suppress(redis.RedisError):
            self.unsubscribe()

    def _pass(self, burst: bool, max_jobs: int | None) -> bool:
        """One pass of the loop; True when the worker is done."""
        self.check_for_suspension(burst)
        self._notice_wake()
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
        self._control_if_due()
        if self.inflight:
            self._finish(self.runner.completions(timeout=BUSY_WAIT_S))
        if not self.runner.alive:
            raise EngineDied("the MLX thread stopped on an error (logged above)")
        self._notice_wake()
        watchdog.check_stall(self.runner, self.inflight, self.stall_timeout, self.awake)
        return False

    def _notice_wake(self) -> None:
        """After this process was stopped or asleep: say so, heartbeat at once (dropping
        the jobs handed on meanwhile) and give the MLX thread a fresh stall window."""
        gap = self.awake.woke()
        if gap is None:
            return
        self.log.warning(
            "Worker %s: this process did not run for %.0fs (stopped, or its machine slept); "
            "checking which of its %d jobs it still holds",
            self.name,
            gap,
            len(self.inflight),
        )
        self._last_beat = 0.0
        if self.inflight:
            self._beat_if_due()

    # -- a hung MLX thread ---------------------------------------------------------------
    def _on_stall(self, e: EngineStalled) -> None:
        """Log it, stop heartbeating, and leave a ``stalled`` record for `mlxq workers`."""
        self.stalled = True
        self.log.error("Worker %s: %s", self.name, e)
        if self.reporter is not None:
            watchdog.record_stall(
                self.reporter, self.connection, self.runner, self.inflight, self.abandon_after
            )

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
        self.owed.chunks += self.runner.stream_chunks()
        for c in completions:
            inf = self.inflight.pop(c.key, None)
            if inf is None:
                continue
            if inf.request.stream:
                self.owed.stream_ends.append((c.key, c.finish_reason))
            self.jobs_done += 1
            tokenizer = getattr(self.runner.engine, "tokenizer", None)  # logprobs' bytes
            result = build_result(inf, c, self.model_name, self.name, tokenizer)
            if self.on_finish is not None:
                self.on_finish(result)
            if self.reporter is not None:
                self.reporter.finished(result)
            if c.finish_reason == "error":
                if result.error is None:
                    result = msgspec.structs.replace(result, error="generation failed")
                self.owed.failed.append(Failure(inf.job, inf.queue, inf.execution, result))
            else:
                self.owed.done.append((inf, result))

    def _flush(self) -> None:
        """Write back everything owed (see :class:`~mlxq.worker.writeback.Writeback`);
        late results of jobs handed to another worker meanwhile are dropped."""
        taken_over(self, self.reporter, self.owed.flush(self, self._fail))

    def _fail(self, f: Failure) -> bool:
        """Fail one job it still holds (retried if it has retries left, else ended with its
        error result), False where another worker took it; the others carry on."""
        f.job.ended_at = now()
        if transitions.fail_or_retry(self, f, f.result) is None:
            return False
        self.log.warning("Worker %s: job %s failed: %s", self.name, f.job.id, f.result.error)
        if self.reporter is not None:
            self.reporter.failed(f.reason)
        return True

    # -- heartbeats, cancels and time limits ---------------------------------------------
    def _beat_if_due(self) -> None:
        """Heartbeats every ``job_monitoring_interval`` seconds (``watchdog.beat``)."""
        if time.monotonic() - self._last_beat < self.job_monitoring_interval:
            return
        self._last_beat = time.monotonic()
        lost = watchdog.beat(self, self.inflight, self.runner, self.abandon_after)
        taken_over(self, self.reporter, lost)

    def _report_if_due(self, force: bool = False) -> None:
        """Publish this worker's state (`mlxq workers`, progress bars, metrics) every
        ``REPORT_INTERVAL_S``, or now with ``force``."""
        if self.reporter is None or self.runner.scheduler is None:
            return
        if not force and time.monotonic() - self._last_report < REPORT_INTERVAL_S:
            return
        self._last_report = time.monotonic()
        self.reporter.publish(
            self.connection,
            self.runner.scheduler,
            len(self.inflight),
            ttl=self.abandon_after,
            memory=self.runner.memory,
            state=self._published_state(),
            step_age_s=watchdog.step_age(self.runner, self.inflight, self.awake),
        )

    def _published_state(self) -> str:
        """The state published: paused (Redis may evict), switching models, or running."""
        if self.intake_paused:
            return "paused"
        return "switching" if self.switcher is not None and self.switcher.busy else "running"

    def _control_if_due(self) -> None:
        """Cancel flags and time limits every ``CONTROL_INTERVAL_S`` (``watchdog.stop_due``)."""
        if not self.inflight or time.monotonic() - self._last_control < CONTROL_INTERVAL_S:
            return
        self._last_control = time.monotonic()
        watchdog.stop_due(self.connection, self.inflight, self.runner)

    # -- stopping ------------------------------------------------------------------------
    def _wind_down(self) -> None:
        """Finish the running jobs within the grace period (a second signal cuts it short);
        jobs pulled but not yet in the batch go back on their queues at once."""
        release(self, self.inflight, self.runner.withdraw_pending(), self.runner, self.reporter)
        deadline = time.monotonic() + self.grace_period
        while (self.inflight or self.owed) and not self._force_stop and time.monotonic() < deadline:
            try:
                self._finish(self.runner.completions(timeout=0.1))
                self._beat_if_due()
            except (redis.ConnectionError, redis.TimeoutError, *WRITE_REFUSALS):
                time.sleep(0.5)

    def _forget(self) -> None:
        """Drop this worker from `mlxq workers` at once on a clean exit."""
        try:
            fleet.remove(self.connection, self.name)
        except redis.RedisError:
            pass  # it expires by itself

    def subscribe(self) -> None:
        """RQ's command channel, polled every quarter second so exiting never waits long
        (RQ's own thread sleeps up to 60 s and teardown waits a second for it)."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=0.25, daemon=True, exception_handler=internals.pubsub_error_handler(self)
        )

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
