"""What a stopping worker leaves behind: the jobs it still holds go back to the front of
their queues for another worker; results it could not write are said out loud.

Only jobs it still holds go back (``transitions.give_back``): a worker that was stopped or
slept past ``--abandon-after`` may find another worker has taken, or finished, the jobs it
thought it held; those are left as that worker left them, so none runs twice.
"""

from __future__ import annotations

import redis
from rq.worker import BaseWorker

from mlxq.broker.rq_store import transitions
from mlxq.engine.runner import Runner
from mlxq.worker.outcomes import InFlight
from mlxq.worker.reporting import Reporter
from mlxq.worker.writeback import Writeback, taken_over


def release_all(
    worker: BaseWorker,
    inflight: dict[str, InFlight],
    runner: Runner,
    owed: Writeback,
    reporter: Reporter | None = None,
) -> None:
    """Put every job still held back on its queue (emptying ``inflight``), and log any
    ended jobs whose results never reached Redis."""
    release(worker, inflight, list(inflight), runner, reporter)
    if owed:
        worker.log.error(
            "Worker %s: exiting with %d results unwritten (Redis unreachable or refusing "
            "writes); their jobs are run again once their heartbeats lapse",
            worker.name,
            len(owed),
        )


def release(
    worker: BaseWorker,
    inflight: dict[str, InFlight],
    keys: list[str],
    runner: Runner,
    reporter: Reporter | None = None,
) -> None:
    """Put the held jobs ``keys`` back at the front of their queues (out of ``inflight``),
    those another worker took meanwhile excepted (said in one line for them all)."""
    items = [inflight.pop(key) for key in keys if key in inflight]
    if not items:
        return
    for inf in items:
        runner.cancel(inf.job.id)
    try:
        held = transitions.give_back(worker, items)
    except redis.RedisError as e:
        worker.log.error(
            "Worker %s: could not put back %d jobs (%s); the other workers put them back "
            "once their heartbeats lapse",
            worker.name,
            len(items),
            e,
        )
        return
    for inf, ok in zip(items, held, strict=True):
        if ok:
            worker.log.info(
                "Worker %s: put job %s back on %s", worker.name, inf.job.id, inf.queue.name
            )
    taken_over(worker, reporter, [inf for inf, ok in zip(items, held, strict=True) if not ok])
