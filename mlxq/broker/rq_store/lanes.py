"""Lanes: each batch's waiting jobs on a queue in a list of their own, so that workers take
higher priorities first and share a queue between equal batches a job at a time.

A submit pushes a batch's job ids onto its lane on the job's queue (``keys.lane``) instead
of the queue's RQ list, and registers the lane in the queue's rotation for the batch's
priority (``keys.lanes``), in the transaction that writes the jobs and their counters. A
lane holds ids in input order; a rotation holds lane keys in round-robin order. Workers
pull (``pull``) from the queues' RQ lists first (retried, requeued and abandoned jobs, and
jobs of plain RQ producers go there), then from the rotations, highest priority first,
moving each id from its lane into the queue's intermediate list in one step, so an id is
never out of every list. A lane is dropped from its rotation once a pull finds it empty (a
later chunk of the same submit registers it again); a cancelled batch's lanes are dropped.

What this assumes of RQ 3.0: ``Queue.enqueue_many`` writes each job (hash, status, queue
set) and pushes its id with ``Queue.push_job_id``, which the queue below overrides to push
onto the lane; every other path that puts a job back (retry, requeue) uses RQ's list.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import redis
from rq.job import Job
from rq.queue import Queue

from mlxq.broker import keys
from mlxq.broker.rq_store.rq_keys import queue_key
from mlxq.broker.serializer import serializer

PRIORITIES = keys.PRIORITIES

# KEYS: 1 the rotation. ARGV: 1 the lane's key. A lane is listed once however many chunks.
_REGISTER = """
if not redis.call('LPOS', KEYS[1], ARGV[1]) then redis.call('RPUSH', KEYS[1], ARGV[1]) end
"""


def check_priority(priority: str) -> str:
    """``priority`` if it is one of ``PRIORITIES``, else a ValueError naming the choices."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority: {priority!r} is not one of {', '.join(PRIORITIES)}")
    return priority


class _LaneQueue(Queue):
    """An RQ queue whose new jobs' ids go onto one batch's lane, not the queue's list."""

    def __init__(self, name: str, lane: str, connection: redis.Redis) -> None:
        super().__init__(name, connection=connection, serializer=serializer)
        self.lane = lane

    def push_job_id(self, job_id: str, pipeline: Any = None, at_front: bool = False) -> None:
        conn = pipeline if pipeline is not None else self.connection
        (conn.lpush if at_front else conn.rpush)(self.lane, job_id)


def enqueue(
    conn: redis.Redis, pipe: Any, queue: str, batch_id: str, priority: str, datas: Sequence[Any]
) -> list[Job]:
    """Queue, in ``pipe``'s transaction, RQ jobs made from ``datas`` (``Queue.prepare_data``)
    with their ids on the batch's lane of ``queue``, the lane in its rotation."""
    lane = keys.lane(queue, batch_id)
    jobs = _LaneQueue(queue, lane, conn).enqueue_many(datas, pipeline=pipe)
    pipe.register_script(_REGISTER)(keys=[keys.lanes(queue, priority)], args=[lane])
    pipe.sadd(keys.batch_lanes(batch_id), queue)
    pipe.expire(keys.batch_lanes(batch_id), keys.BATCH_TTL)
    return jobs


def rotations(queues: Iterable[str]) -> list[str]:
    """The rotation keys of ``queues``, in the order a worker takes from them: every
    queue's high priority, then every queue's normal, then low."""
    names = list(queues)
    return [keys.lanes(q, p) for p in PRIORITIES for q in names]


def lanes_of(conn: redis.Redis, queues: Sequence[str]) -> dict[str, list[str]]:
    """The keys of each queue's lanes that hold (or held, until a pull saw them empty)
    waiting ids, every priority, in one round trip."""
    with conn.pipeline(transaction=False) as pipe:
        for queue in queues:
            for rotation in rotations([queue]):
                pipe.lrange(rotation, 0, -1)
        found = iter(pipe.execute())
    return {
        q: list(dict.fromkeys(k.decode() for _ in PRIORITIES for k in next(found))) for q in queues
    }


def lane_keys(conn: redis.Redis, queue: str) -> list[str]:
    """The keys of the lanes of ``queue`` (:func:`lanes_of`)."""
    return lanes_of(conn, [queue])[queue]


def waiting(conn: redis.Redis, queues: Sequence[str]) -> dict[str, int]:
    """How many job ids wait on each of ``queues``: its RQ list and its lanes."""
    lanes = lanes_of(conn, queues)
    with conn.pipeline(transaction=False) as pipe:
        for q in queues:
            for listed in (queue_key(q), *lanes[q]):
                pipe.llen(listed)
        lengths = iter(pipe.execute())
    return {q: sum(next(lengths) for _ in range(1 + len(lanes[q]))) for q in queues}


def heads(conn: redis.Redis, queues: Sequence[str], n: int) -> dict[str, list[str]]:
    """The first ``n`` ids of each queue's RQ list and of each of its lanes (the oldest
    waiting job is among them)."""
    lanes = lanes_of(conn, queues)
    with conn.pipeline(transaction=False) as pipe:
        for q in queues:
            for listed in (queue_key(q), *lanes[q]):
                pipe.lrange(listed, 0, n - 1)
        found = iter(pipe.execute())
    return {q: [i.decode() for _ in range(1 + len(lanes[q])) for i in next(found)] for q in queues}


def drop_batch(conn: redis.Redis, batch_id: str) -> None:
    """Delete the batch's lanes and take them out of their rotations (its waiting jobs are
    cancelled first: what a lane still holds then never runs)."""
    queues = [q.decode() for q in conn.smembers(keys.batch_lanes(batch_id))]
    with conn.pipeline(transaction=True) as pipe:
        for queue in queues:
            lane = keys.lane(queue, batch_id)
            for rotation in rotations([queue]):
                pipe.lrem(rotation, 0, lane)
            pipe.delete(lane)
        pipe.delete(keys.batch_lanes(batch_id))
        pipe.execute()
