"""What a stopping worker leaves behind: the jobs it still holds go back to the front of
their queues for another worker; results it could not write are said out loud."""

from __future__ import annotations

import redis
from rq.worker import BaseWorker

from mlxq.broker.rq_store import transitions
from mlxq.engine.runner import Runner
from mlxq.worker.outcomes import InFlight
from mlxq.worker.writeback import Writeback


def release_all(
    worker: BaseWorker, inflight: dict[str, InFlight], runner: Runner, owed: Writeback
) -> None:
    """Put every job still held back on its queue (emptying ``inflight``), and log any
    ended jobs whose results never reached Redis."""
    release(worker, inflight, list(inflight), runner)
    if owed:
        worker.log.error(
            "Worker %s: exiting with %d results unwritten (Redis unreachable or refusing "
            "writes); their jobs are run again once their heartbeats lapse",
            worker.name,
            len(owed),
        )


def release(worker: BaseWorker, inflight: dict[str, InFlight], keys: list[str], runner: Runner):
    """Put the held jobs ``keys`` back at the front of their queues (out of ``inflight``)."""
    for key in keys:
        inf = inflight.get(key)
        if inf is None:
            continue
        runner.cancel(key)
        try:
            with worker.connection.pipeline() as pipe:
                transitions.put_back(pipe, worker, inf.job, inf.queue, inf.execution)
                pipe.execute()
            worker.log.info("Worker %s: put job %s back on %s", worker.name, key, inf.queue.name)
        except redis.RedisError as e:
            worker.log.error(
                "Worker %s: could not requeue %s (%s); the other workers "
                "will put it back once its heartbeat lapses",
                worker.name,
                key,
                e,
            )
        del inflight[key]
