"""Where RQ holds a job, and putting back a job that nothing holds.

A job that waits or runs is always in one of four places: its queue's list, its batch's
lane on the queue (``lanes``: where submits put jobs), the queue's intermediate list (pulled,
not yet started), or the queue's started registry (one entry per execution,
``job_id:execution_id``). Every state change mlxq makes moves a job between them
atomically, so a job whose status says ``queued`` or ``started`` and that none of them holds
was lost by a path mlxq does not know (RQ's own BLPOP dequeue did this before ``pull``; a
person's ``LREM``; a client that died half way through a script-less write). The sweep in
``mlxq.broker.unaccounted`` finds such jobs with the reads here and puts each back once;
``mlxq status`` lists them with the reads alone (no transaction, no write: Redis 7 refuses
every command queued in a MULTI while it is full, reads too).

Assumptions about RQ 3.0: the RQ places above, named by ``Queue.key``,
``Queue.intermediate_queue_key`` and ``started_key``; a job's executions are listed in
``executions_key``; its queue is the hash's ``origin`` field.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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

# KEYS: 1 queue, 2 intermediate list, 3 started registry, then each job's hash and its
# executions. ARGV: 1 the queue name, then the job ids. Returns the ids that wait or run by
# their status, on this queue, and that none of the three places holds. Reads only.
_UNHELD = """
local out = {}
for i = 2, #ARGV do
  local id, job, ex = ARGV[i], KEYS[2 * i], KEYS[2 * i + 1]
  local status = redis.call('HGET', job, 'status')
  local unheld = (status == 'queued' or status == 'started')
    and redis.call('HGET', job, 'origin') == ARGV[1]
    and not redis.call('LPOS', KEYS[1], id)
    and not redis.call('LPOS', KEYS[2], id)
  if unheld then
    for _, e in ipairs(redis.call('ZRANGE', ex, 0, -1)) do
      if redis.call('ZSCORE', KEYS[3], id .. ':' .. e) then unheld = false end
    end
  end
  if unheld then out[#out + 1] = id end
end
return out
"""
UNHELD_CHUNK = 500

Whereabouts = Literal["held", "unheld", "requeued"]
_OUTCOME: dict[int, Whereabouts] = {0: "held", 1: "unheld", 2: "requeued"}


def holders_count(conn: redis.Redis, queue: str) -> int:
    """How many entries the queue's places hold (a cheap upper bound on the jobs they
    hold). Plain reads, no transaction: Redis 7 refuses every command queued in a
    transaction while it is full, even a read."""
    intermediate = Queue(queue, connection=conn).intermediate_queue_key
    lane_keys = lanes.lane_keys(conn, queue)
    with conn.pipeline(transaction=False) as pipe:
        pipe.llen(queue_key(queue))
        for lane in lane_keys:
            pipe.llen(lane)
        pipe.llen(intermediate)
        pipe.zcard(started_key(queue))
        return sum(pipe.execute())


def room_for(conn: redis.Redis, batch_id: str, queues: Sequence[str]) -> dict[str, int]:
    """Per queue, how many entries the places that can hold the batch's jobs on it hold:
    the batch's lane, the queue's list, intermediate list and started registry (an upper
    bound on how many of its jobs they hold). One round trip of plain reads, whatever the
    batch's size."""
    with conn.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.llen(keys.lane(queue, batch_id))
            pipe.llen(queue_key(queue))
            pipe.llen(Queue(queue, connection=conn).intermediate_queue_key)
            pipe.zcard(started_key(queue))
        found = pipe.execute()
    return {q: sum(found[4 * i : 4 * i + 4]) for i, q in enumerate(queues)}


def held_ids(
    conn: redis.Redis, queue: str, batch_id: str | None = None, atomic: bool = True
) -> set[str]:
    """The ids of every job the queue's list, lanes, intermediate list and started registry
    hold (of the lanes, only ``batch_id``'s if given).

    ``atomic``: read in one transaction (a lane registered after the rotations were read
    holds only jobs submitted since: ``put_back_if_unheld`` looks in it before it moves
    one). Otherwise plain reads, in the order a job moves between the places (so a job
    moving on while they are read is seen), for readers that must work on a full Redis
    and confirm what they find with :func:`unheld`."""
    intermediate = Queue(queue, connection=conn).intermediate_queue_key
    lane_keys = [keys.lane(queue, batch_id)] if batch_id else lanes.lane_keys(conn, queue)
    with conn.pipeline(transaction=atomic) as pipe:
        for waiting in (queue_key(queue), *lane_keys, intermediate):
            pipe.lrange(waiting, 0, -1)
        pipe.zrange(started_key(queue), 0, -1)
        *lists, started = pipe.execute()
    ids = {i.decode() for listed in lists for i in listed}
    return ids | {member.decode().split(":", 1)[0] for member in started}


def unheld(conn: redis.Redis, queue: str, job_ids: Sequence[str]) -> list[str]:
    """Of ``job_ids`` (jobs enqueued on ``queue`` that no lane held when its places were
    last read), those that wait or run by their status while the queue's list,
    intermediate list and started registry hold none of them, checked atomically, a
    chunk at a time, by a script that only reads (Redis runs it even when full). Lanes
    are not looked in: ids only ever enter a lane when they are submitted."""
    out: list[str] = []
    check = conn.register_script(_UNHELD)
    fixed = [queue_key(queue), Queue(queue, connection=conn).intermediate_queue_key]
    for at in range(0, len(job_ids), UNHELD_CHUNK):
        chunk = job_ids[at : at + UNHELD_CHUNK]
        per_job = [k for j in chunk for k in (job_key(j), executions_key(j))]
        found = check(keys=[*fixed, started_key(queue), *per_job], args=[queue, *chunk])
        out += [raw.decode() for raw in found]
    return out


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
