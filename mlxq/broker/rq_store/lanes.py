"""Lanes: each batch's waiting jobs on a queue in a list of their own, so that workers take
higher priorities first and share themselves between equal batches a job at a time, on all
their queues together.

A submit pushes a batch's job ids onto its lane on the job's queue (``keys.lane``) instead
of the queue's RQ list, and registers the lane in the queue's rotation for the batch's
priority (``keys.lanes``), in the transaction that writes the jobs and their counters. A
lane holds ids in input order; a rotation holds lane keys in round-robin order.

Workers pull (``pull``) from the queues' RQ lists first, then from the rotations, every
queue's high before any queue's normal before any low (strict: no aging, so a steady stream
of higher work starves lower work). Within a priority the lanes of all the worker's queues
are one round robin: each pull takes from the lane, at the head of its queue's rotation,
that was taken from least recently (its turn in :func:`turns`, a counter shared by every
queue; a lane never taken from counts as turn 0), and sends it to the back of its rotation
with the next turn. So a queue's rotation stays in turn order (a new lane joins at the
back), its head is its least recently served lane, and the oldest turn among the heads is
the next batch's, whichever queue it waits on: equal batches alternate over a worker's
queues as on one. A lane is one batch on one queue (a batch split over two queues has two
turns); workers on different sets of queues share the same turns.
Every id moves from its lane into its queue's intermediate list in one step, so an id is
never out of every list. A lane is dropped from its rotation (and its turn forgotten) once
a pull finds it empty (a later chunk of the same submit registers it again); a cancelled
batch's lanes are dropped.

RQ lists first (kept: it does not undo the sharing): they hold retried jobs and jobs put
back after a worker died or stopped (each already had its batch's turn once, and they are
few), and jobs that plain RQ producers pushed (no batch, no priority). A batch's waiting
jobs are all in its lanes, so no batch can hold a worker through RQ's lists; only a
producer flooding a queue's RQ list directly holds the lanes back, as on plain RQ.

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
    queue's high priority, then every queue's normal, then low (within a priority, the
    queues' lanes share turns: ``pull``)."""
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


def drop_lua(first_key: int, first_arg: int) -> str:
    """Lua, a step of a longer script, that deletes a batch's lanes and takes them out of
    their rotations and turns, inside the script's one atomic step (a batch's cancel marks
    the batch and drops its lanes together). KEYS from ``first_key`` on, to the last:
    :func:`drop_keys`'s; ARGV from ``first_arg`` on, to the last: the lanes' queues.
    Leaves in the Lua local ``lanes_left`` how many queues the batch's set still names (a
    submit's chunk that registered a lane after the caller read the set: read it again and
    drop that one)."""
    per = 1 + len(PRIORITIES)
    return f"""
local lanes_left
do
  local set, turns = KEYS[{first_key}], KEYS[{first_key + 1}]
  local i = {first_key + 2}
  while i <= #KEYS do
    local lane = KEYS[i]
    for r = 1, {per - 1} do redis.call('LREM', KEYS[i + r], 0, lane) end
    redis.call('DEL', lane)
    redis.call('HDEL', turns, lane)
    i = i + {per}
  end
  for a = {first_arg}, #ARGV do redis.call('SREM', set, ARGV[a]) end
  lanes_left = redis.call('SCARD', set)
end
"""


def drop_keys(conn: redis.Redis, batch_id: str) -> tuple[list[str], list[str]]:
    """:func:`drop_lua`'s keys (the batch's set of lane queues, :func:`turns`, then each
    lane and its rotations) and arguments (the queues), for the lanes its set names now."""
    queues = sorted(q.decode() for q in conn.smembers(keys.batch_lanes(batch_id)))
    keys_ = [keys.batch_lanes(batch_id), keys.lane_turns()]
    for queue in queues:
        keys_ += [keys.lane(queue, batch_id), *rotations([queue])]
    return keys_, queues
