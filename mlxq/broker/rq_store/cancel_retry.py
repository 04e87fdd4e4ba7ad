"""What an operator asks of a batch's jobs: cancel the ones still waiting (each stores a
``cancelled`` result), retry the failed ones. Each check and write is one optimistic
transaction, so a job a worker takes meanwhile is left to that worker."""

from __future__ import annotations

from collections.abc import Sequence

import redis
from rq.exceptions import InvalidJobOperation
from rq.job import Job, JobStatus
from rq.queue import Queue

from mlxq.broker import keys
from mlxq.broker.rq_store.counters import batch_of, move
from mlxq.broker.rq_store.internals import enqueue_again
from mlxq.broker.rq_store.reads import chunks, job_states
from mlxq.broker.rq_store.rq_keys import job_key
from mlxq.broker.rq_store.states import WAITING
from mlxq.broker.rq_store.transitions import end_job, result_without_output
from mlxq.broker.serializer import serializer


def cancel_waiting(conn: redis.Redis, job_ids: Sequence[str], from_lanes: bool = True) -> int:
    """Cancel, through RQ, every job among ``job_ids`` that is still waiting to run; each
    stores a ``cancelled`` result. Returns how many. A job a worker takes meanwhile is left
    to that worker (the check and the cancel are one optimistic transaction).

    ``from_lanes``: each id also leaves its batch's lane (one scan of the lane each: a
    whole batch's cancel passes False and deletes its lanes at once instead)."""
    cancelled = 0
    for chunk in chunks(job_ids, 500):
        states = job_states(conn, chunk)
        waiting = [jid for jid, s in zip(chunk, states, strict=True) if s in WAITING]
        if waiting:
            cancelled += _cancel_chunk(conn, waiting, from_lanes)
    return cancelled


def _cancel_chunk(conn: redis.Redis, job_ids: list[str], from_lanes: bool) -> int:
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(*[job_key(j) for j in job_ids])
                jobs = Job.fetch_many(job_ids, connection=conn, serializer=serializer)
                still = [
                    j for j in jobs if j is not None and j.get_status(refresh=False) in WAITING
                ]
                pipe.multi()
                for job in still:
                    job.cancel(pipeline=pipe)
                    batch = batch_of(job)
                    if from_lanes and batch is not None:
                        pipe.lrem(keys.lane(job.origin, batch), 1, job.id)
                    result = result_without_output(job, "cancelled", "cancelled before it started")
                    queue = Queue(job.origin, connection=conn, serializer=serializer)
                    end_job(pipe, job, queue, result)
                pipe.execute()
                return len(still)
            except (redis.WatchError, InvalidJobOperation):
                # A worker took one meanwhile, or another canceller got there first (RQ's
                # cancel reads the status afresh and refuses a cancelled job): look again.
                pipe.reset()


def retry_failed(conn: redis.Redis, job_ids: Sequence[str]) -> int:
    """Put the failed jobs among ``job_ids`` back on their queues; returns how many."""
    count = 0
    for jid, state in zip(job_ids, job_states(conn, job_ids), strict=True):
        if state == "failed" and _retry_one(conn, jid):
            count += 1
    return count


def _retry_one(conn: redis.Redis, job_id: str) -> bool:
    with conn.pipeline() as pipe:
        try:
            pipe.watch(job_key(job_id))
            job = Job.fetch(job_id, connection=conn, serializer=serializer)
            if job.get_status(refresh=False) != JobStatus.FAILED:
                return False
            queue = Queue(job.origin, connection=conn, serializer=serializer)
            job.started_at = job.ended_at = None
            pipe.multi()
            pipe.zrem(job.failed_job_registry.key, job.id)
            move(pipe, job.id, batch_of(job), "queued")
            enqueue_again(queue, job, pipe, at_front=False)
            pipe.execute()
            return True
        except redis.WatchError:
            return False  # changed meanwhile (retried by someone else)
