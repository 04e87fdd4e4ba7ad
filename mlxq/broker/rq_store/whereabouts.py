"""Where RQ holds a job, and putting back a job that nothing holds.

A job that waits or runs is always in one of four places: its queue's list, its batch's
lane on the queue (``lanes``: where submits put jobs), the queue's intermediate list (pulled,
not yet started), or the queue's started registry (one entry per execution,
``job_id:execution_id``). Every state change mlxq makes moves a job between them
atomically, so a job whose status says ``queued`` or ``started`` and that none of them holds
was lost by a path mlxq does not know (RQ's own BLPOP dequeue did this before ``pull``; a
person's ``LREM``; a client that died half way through a script-less write). The sweep in
``mlxq.broker.unaccounted`` finds such jobs with the reads here and puts each back once.

Assumptions about RQ 3.0: the RQ places above, named by ``Queue.key``,
``Queue.intermediate_queue_key`` and ``started_key``; a job's executions are listed in
``executions_key``; its queue is the hash's ``origin`` field.
"""

from __future__ import annotations

import time
from typing import Literal

import redis
from rq.queue import Queue

from mlxq.broker import keys
from mlxq.broker.rq_store import lanes
from mlxq.broker.rq_store.counters import move_step_lua
from mlxq.broker.rq_store.rq_keys import executions_key, job_key, queue_key, started_key

# KEYS: 1 job hash, 2 queue, 3 intermediate list, 4 started registry, 5 the job's
# executions, 6 the queue's unaccounted marks, 7 batch counters (or the job hash again),
# 8 the batch's lane on the queue (a key never written when the job has no batch).
# ARGV: 1 job id, 2 now, 3 grace seconds, 4 the queue name, 5 "1" when counted in a
# batch, 6 the marks' expiry. Returns 0 (held, or not waiting), 1 (unheld, marked or
# within its grace) or 2 (put back on its queue).
_PUT_BACK = (
    """
local status = redis.call('HGET', KEYS[1], 'status')
local unheld = (status == 'queued' or status == 'started')
  and redis.call('HGET', KEYS[1], 'origin') == ARGV[4]
  and not redis.call('LPOS', KEYS[2], ARGV[1])
  and not redis.call('LPOS', KEYS[3], ARGV[1])
  and not redis.call('LPOS', KEYS[8], ARGV[1])
if unheld then
  for _, ex in ipairs(redis.call('ZRANGE', KEYS[5], 0, -1)) do
    if redis.call('ZSCORE', KEYS[4], ARGV[1] .. ':' .. ex) then unheld = false end
  end
end
if not unheld then
  redis.call('HDEL', KEYS[6], ARGV[1])
  return 0
end
local seen = redis.call('HGET', KEYS[6], ARGV[1])
if not seen then
  redis.call('HSET', KEYS[6], ARGV[1], ARGV[2])
  redis.call('EXPIRE', KEYS[6], ARGV[6])
  return 1
end
if tonumber(ARGV[2]) - tonumber(seen) < tonumber(ARGV[3]) then return 1 end
"""
    + move_step_lua("KEYS[1]", "KEYS[7]", "'queued'", when="ARGV[5] == '1'")
    + """
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('LPUSH', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
return 2
"""
)

Whereabouts = Literal["held", "unheld", "requeued"]
_OUTCOME: dict[int, Whereabouts] = {0: "held", 1: "unheld", 2: "requeued"}


def holders_count(conn: redis.Redis, queue: str) -> int:
    """How many entries the queue's places hold (a cheap upper bound on the jobs they
    hold)."""
    intermediate = Queue(queue, connection=conn).intermediate_queue_key
    lane_keys = lanes.lane_keys(conn, queue)
    with conn.pipeline(transaction=True) as pipe:
        pipe.llen(queue_key(queue))
        for lane in lane_keys:
            pipe.llen(lane)
        pipe.llen(intermediate)
        pipe.zcard(started_key(queue))
        return sum(pipe.execute())


def held_ids(conn: redis.Redis, queue: str) -> set[str]:
    """The ids of every job the queue's list, lanes, intermediate list and started registry
    hold, read in one transaction (a lane registered after the rotations were read holds
    only jobs submitted since: ``put_back_if_unheld`` looks in it before it moves one)."""
    intermediate = Queue(queue, connection=conn).intermediate_queue_key
    lane_keys = lanes.lane_keys(conn, queue)
    with conn.pipeline(transaction=True) as pipe:
        for waiting in (queue_key(queue), *lane_keys, intermediate):
            pipe.lrange(waiting, 0, -1)
        pipe.zrange(started_key(queue), 0, -1)
        *lists, started = pipe.execute()
    ids = {i.decode() for listed in lists for i in listed}
    return ids | {member.decode().split(":", 1)[0] for member in started}


def origins(conn: redis.Redis, job_ids: list[str]) -> list[str | None]:
    """The queue each job was enqueued on (None where its hash is gone)."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(job_key(job_id), "origin")
        return [raw.decode() if raw else None for raw in pipe.execute()]


def forget_marks(conn: redis.Redis, queue: str) -> None:
    """Drop the queue's marks: a sweep found every live job of it held."""
    conn.delete(keys.unaccounted(queue))


def put_back_if_unheld(
    conn: redis.Redis, job_id: str, queue: str, batch_id: str | None, grace_s: float
) -> Whereabouts:
    """Check, atomically, that nothing holds a waiting or running job: the first time it
    is seen so it is marked; seen so again ``grace_s`` later it goes back on its queue
    (status ``queued``, its batch counter with it), once."""
    intermediate = Queue(queue, connection=conn).intermediate_queue_key
    hash_key = job_key(job_id)
    keys_ = [
        hash_key,
        queue_key(queue),
        intermediate,
        started_key(queue),
        executions_key(job_id),
        keys.unaccounted(queue),
        keys.batch_counts(batch_id) if batch_id else hash_key,
        keys.lane(queue, batch_id or ""),
    ]
    args = [job_id, time.time(), grace_s, queue, "1" if batch_id else "0"]
    code = conn.register_script(_PUT_BACK)(keys=keys_, args=[*args, max(7200, 2 * int(grace_s))])
    return _OUTCOME[int(code)]
