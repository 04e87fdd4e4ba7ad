"""The RQ worker that mlxq's worker builds on: RQ 3.0's ``BaseWorker`` with mlxq's JSON
serializer and its settings, and the parts of RQ's worker behaviour mlxq changes (RQ's
internals, kept here with the rest of them: ``internals``).

- Executions expire ``abandon_after`` seconds after their last heartbeat, and the worker
  heartbeats every third of that: a job whose worker misses three is put back by others.
- Its registries' maintenance leaves RQ's intermediate lists alone (RQ would fail the jobs
  stranded there; mlxq's sweep puts them back on their queues).
- RQ's command channel is polled every quarter second (RQ's thread sleeps up to 60 s, and
  its teardown waits for it), and torn down part by part, so that a Redis away or full
  never leaves its thread running.
- A second signal only sets a flag the loop reads: a handler never raises.
"""

from __future__ import annotations

import contextlib

import redis
from rq.job import Job
from rq.worker import BaseWorker

from mlxq.broker import keys
from mlxq.broker.rq_store import internals
from mlxq.broker.serializer import serializer


class RQWorkerBase(BaseWorker):
    """RQ's worker as mlxq runs it (see the module docstring); the loop is the subclass's."""

    def __init__(
        self, queues: list[str], *, connection: redis.Redis, name: str | None, abandon_after: int
    ) -> None:
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
        self.force_stop = False  # a second signal: stop at once

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """Executions expire ``abandon_after`` seconds after the last heartbeat."""
        return self.abandon_after

    def request_force_stop(self, signum, frame) -> None:
        self.force_stop = True

    def clean_registries(self) -> None:
        """RQ's maintenance of its registries, less the cleanup that fails stranded jobs."""
        internals.clean_registries_but_intermediate(self)

    def subscribe(self) -> None:
        """RQ's command channel, polled every quarter second so exiting never waits long."""
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=0.25, daemon=True, exception_handler=internals.pubsub_error_handler(self)
        )

    def teardown_quietly(self) -> None:
        """RQ's teardown, each part on its own (its record and channel expire by
        themselves where Redis is away or full)."""
        with contextlib.suppress(redis.RedisError):
            self.register_death()
        with contextlib.suppress(redis.RedisError):
            self.unsubscribe()
