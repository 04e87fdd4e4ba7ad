"""Taking jobs: the worker's pulls into the engine, and the sweeps that put back what dead
workers, stranded pulls or unknown paths left on its queues.

A mixin of :class:`~mlxq.worker.rq_worker.MlxqWorker` (the loop calls ``_maintain`` and
``_pull`` each pass); it reads the worker's runner, in-flight jobs and write-back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import redis
from rq.job import Job
from rq.queue import Queue

from mlxq.broker import intake, unaccounted
from mlxq.broker.keys import queue_name_for_model
from mlxq.broker.recovery import requeue_abandoned, requeue_stranded
from mlxq.broker.rq_store import internals, transitions
from mlxq.broker.rq_store.job_loading import Unreadable
from mlxq.engine.runner import Work
from mlxq.engine.sampling import EngineJob
from mlxq.worker.outcomes import InFlight, unrun_result
from mlxq.worker.vetting import Elsewhere, Refused, Served, Vetted, vet
from mlxq.worker.writeback import Failure, Redirect

if TYPE_CHECKING:
    from mlxq.worker.rq_worker import MlxqWorker

EMPTY_PULL_BACKOFF_S = 0.25  # after an empty pull, wait before asking Redis again
IDLE_PULL_TIMEOUT_S = 1  # blocking pull when idle: short, so stop requests are seen
RECOVERY_INTERVAL_S = 5.0  # how often abandoned jobs of dead workers are looked for


class JobIntake:
    """Pulling, vetting and starting jobs, and sweeping the worker's queues."""

    def clean_registries(self: MlxqWorker) -> None:
        """RQ's maintenance of its registries, less the cleanup that fails stranded jobs:
        ``_maintain`` puts them back on their queues."""
        internals.clean_registries_but_intermediate(self)

    def _maintain(self: MlxqWorker) -> None:
        # Swept right before RQ's own maintenance too: RQ would fail abandoned jobs
        # (bypassing the batch counters) where mlxq puts them back.
        maintenance = self.should_run_maintenance_tasks
        if maintenance or time.monotonic() - self._last_sweep >= RECOVERY_INTERVAL_S:
            self._last_sweep = time.monotonic()
            self._sweep()
        if maintenance:
            self.run_maintenance_tasks()

    def _sweep(self: MlxqWorker) -> None:
        """Put back the jobs of this worker's queues that dead workers, stranded pulls or
        unknown paths left behind (``recovery``, ``unaccounted``); count them by how."""
        grace = self.abandon_after
        names = [queue.name for queue in self.queues]
        swept = {
            "abandoned": [j for q in self.queues for j in requeue_abandoned(q)],
            "stranded": [j for q in self.queues for j in requeue_stranded(q, grace)],
            "unaccounted": unaccounted.sweep(self.connection, names, grace, RECOVERY_INTERVAL_S),
        }
        if self.reporter is not None:
            for how, job_ids in swept.items():
                self.reporter.recovered(how, job_ids)

    def _pull(self: MlxqWorker, block: bool) -> int:
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

    def _served(self: MlxqWorker) -> Served:
        """The models this worker serves, the loaded one first (what vetting checks)."""
        if self.switcher is None:
            return Served(self.model_name, {self.model_name: queue_name_for_model(self.model_name)})
        own = {m: queue_name_for_model(m) for m in self.switcher.queues}
        return Served(self.switcher.active, own)

    def _start_group(self: MlxqWorker, group: list[tuple[Job, Queue]]) -> None:
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
            elif isinstance(v, Elsewhere):
                self.owed.redirected.append(Redirect(job, queue, execution, v.queue))
            elif isinstance(v, Refused):
                result = transitions.result_without_output(
                    job,
                    "error",
                    v.error,
                    model=self.model_name,
                    worker=self.name,
                    prompt_tokens=v.prompt_tokens,
                )
                self.owed.failed.append(Failure(job, queue, execution, result, "rejected"))
            else:
                inf = InFlight(
                    job, queue, execution, v.request, v.meta, handed, None, len(v.tokens)
                )
                if v.expired:
                    msg = "the batch expired before this request ran"
                    result = unrun_result(inf, "expired", msg, self.model_name, self.name)
                    self.owed.done.append((inf, result))
                else:
                    self.inflight[job.id] = inf
        self._flush()
