"""Recovering jobs from workers that died (SIGKILL, power loss, a laptop that slept).

A running job is listed in RQ's StartedJobRegistry under ``job_id:execution_id`` with a
score that its worker's heartbeat keeps pushing forward. When the score falls behind the
clock, the worker is gone: RQ itself would mark such a job failed; mlxq puts it back at the
front of its queue so another worker runs it. A job that keeps killing its workers (say it
runs a machine out of memory) is failed after ``max_abandons`` tries instead of looping.

A job can also be stranded before it is registered: a worker moves ids from a queue to
RQ's intermediate queue, then registers them, and if it dies (or Redis goes away) in
between, the ids stay there with status ``queued``. RQ's own cleanup fails such jobs after
a minute, ten minutes apart; mlxq puts them back once they have sat there ``grace_s``.

What the sweeps assume of RQ 3.0: a running job's execution is in its queue's started
registry scored by its heartbeat's expiry (``Worker.prepare_execution`` and mlxq's
``start_script`` both write it so); a pulled job sits in the queue's intermediate list
(only ``pull`` takes jobs: RQ's own ``dequeue_any`` pops with BLPOP on several queues and
leaves them in no list); RQ's own cleanup of the intermediate list, which would fail
stranded jobs, is not run (``internals.clean_registries_but_intermediate``). A job in none
of these places is ``unaccounted``'s business.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis
from rq.job import Job
from rq.queue import Queue
from rq.utils import current_timestamp, parse_composite_key

from mlxq.broker import keys, unaccounted
from mlxq.broker.rq_store import reads, rq_keys, states, transitions
from mlxq.wire import Result

log = logging.getLogger("mlxq.broker.recovery")

MAX_ABANDONS = 3


def abandons_key(job_id: str) -> str:
    """How many times a dead worker has left this job behind."""
    return f"{keys.PREFIX}:abandons:{job_id}"


def requeue_stranded(queue: Queue, grace_s: float, at_once: bool = False) -> list[str]:
    """Put back every job left in ``queue``'s intermediate queue, unregistered, for at least
    ``grace_s`` seconds (from the first sweep that saw it); returns their ids. ``at_once``:
    every one now, for a caller that knows no worker of the queue lives."""
    conn = queue.connection
    moved = []
    for raw in conn.lrange(queue.intermediate_queue_key, 0, -1):
        job_id = raw.decode() if isinstance(raw, bytes) else raw
        if _requeue_stranded_one(queue, job_id, grace_s, at_once):
            moved.append(job_id)
    return moved


def _requeue_stranded_one(queue: Queue, job_id: str, grace_s: float, at_once: bool) -> bool:
    conn = queue.connection
    with conn.pipeline() as pipe:
        try:
            # Registering a job writes its hash and takes its id out of the intermediate
            # queue in one transaction: watching the hash sees a registration race.
            pipe.watch(rq_keys.job_key(job_id))
            status = pipe.hget(rq_keys.job_key(job_id), "status")
            if status is not None and status.decode() in states.ENDED:
                # Cancelled while its worker held it unregistered: it never runs; forget it.
                pipe.multi()
                transitions.requeue_stranded_one(pipe, queue, job_id, requeue=False)
                pipe.execute()
                return False
            if status not in (b"queued", None):
                return False  # registered meanwhile, or another writer's business
            seen = pipe.get(keys.stranded(job_id))
            if seen is None and not at_once:
                # Outlives any grace (abandon_after is at most an hour); a mark left by a
                # race with the job's registration just expires.
                pipe.set(keys.stranded(job_id), time.time(), ex=max(2 * 3600, 2 * int(grace_s)))
                return False
            if status is not None and not at_once and time.time() - float(seen) < grace_s:
                return False
            pipe.multi()
            transitions.requeue_stranded_one(pipe, queue, job_id, requeue=status is not None)
            pipe.execute()
        except redis.WatchError:
            return False
    if status is not None:
        log.warning(
            "job %s: stranded before it was registered; put it back on %s", job_id, queue.name
        )
    return status is not None


def requeue_abandoned(
    queue: Queue, max_abandons: int = MAX_ABANDONS, all_started: bool = False
) -> list[str]:
    """Put back every job of ``queue`` whose worker stopped heartbeating; returns their ids.
    ``all_started``: every running job, for a caller that knows no worker of the queue
    lives (``mlxq run`` resuming on its own embedded server)."""
    conn = queue.connection
    registry = queue.started_job_registry
    moved = []
    until = "+inf" if all_started else current_timestamp()
    for member in conn.zrangebyscore(registry.key, 0, until):
        member = member.decode() if isinstance(member, bytes) else member
        job_id, execution_id = parse_composite_key(member)
        if _requeue_one(queue, registry.key, member, job_id, execution_id, max_abandons):
            moved.append(job_id)
    return moved


def _requeue_one(
    queue: Queue, registry_key: str, member: str, job_id: str, execution_id: str, limit: int
) -> bool:
    conn = queue.connection
    job_key = rq_keys.job_key(job_id)
    with conn.pipeline() as pipe:
        try:
            pipe.watch(job_key, registry_key)
            status = pipe.hget(job_key, "status")
            if status != b"started" or pipe.zscore(registry_key, member) is None:
                pipe.multi()
                pipe.zrem(registry_key, member)
                pipe.execute()
                return False
            tries = int(pipe.get(abandons_key(job_id)) or 0) + 1
            failed = _failure(queue, job_id, tries) if tries > limit else None
            batch_id = reads.batch_id_of(pipe, job_id)
            pipe.multi()
            transitions.drop_execution(pipe, registry_key, member, job_id, execution_id)
            pipe.set(abandons_key(job_id), tries, ex=keys.BATCH_TTL)
            if failed is not None:
                transitions.end_job(pipe, failed[0], queue, failed[1])
            else:
                transitions.requeue_abandoned_one(pipe, queue, job_id, batch_id)
            pipe.execute()
        except redis.WatchError:
            return False  # someone else (the worker itself, or another sweeper) got there first
    log.warning(
        "job %s: its worker stopped heartbeating; %s (attempt %d)",
        job_id,
        "failed it" if tries > limit else f"put it back on {queue.name}",
        tries,
    )
    return True


def _failure(queue: Queue, job_id: str, tries: int) -> tuple[Job, Result]:
    """The job and the error result it ends with after too many abandons."""
    job = Job.fetch(job_id, connection=queue.connection, serializer=queue.serializer)
    message = (
        f"abandoned {tries} times by workers that died while running it (killed, crashed or "
        "out of memory); not retried again. Check the workers' logs and the request's size"
    )
    return job, transitions.result_without_output(job, "error", message, worker=job.worker_name)


def sweep(queues: Sequence[Queue], grace_s: float, every_s: float) -> dict[str, list[str]]:
    """Put back, on ``queues``, the jobs of dead workers (``abandoned``), those stranded
    between a pull and their registration (``stranded``) and those no list or registry
    holds (``unaccounted``, at most once per ``every_s`` across the fleet); their ids by
    how they were left."""
    conn = queues[0].connection if queues else None
    names = [queue.name for queue in queues]
    return {
        "abandoned": [j for q in queues for j in requeue_abandoned(q)],
        "stranded": [j for q in queues for j in requeue_stranded(q, grace_s)],
        "unaccounted": unaccounted.sweep(conn, names, grace_s, every_s) if conn else [],
    }
