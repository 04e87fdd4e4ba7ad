"""Taking job ids off RQ queues into RQ's intermediate lists: never out of every list.

RQ 3.0's own dequeue (``Queue.dequeue_any``) moves an id into the queue's intermediate
list (``BLMOVE``) only when a worker listens on one queue; on several it pops with
``BLPOP``, and the popped id sits in no list until the job is registered. A worker that
dies (or a start that is refused) in between loses the job for good. mlxq therefore never
calls RQ's dequeue: every pull here is a move (``LMOVE``/``BLMOVE``, left of the queue to
the right of its intermediate list, as RQ's one-queue path does), so from the moment an id
leaves its queue it is in a list that ``recovery.requeue_stranded`` sweeps. The paths are
the same on one queue and on several: one script that moves ids over all the worker's
queues (:func:`take`), and, while idle, a blocking move on the first queue's RQ list
(:func:`wait_move`); ``tests/broker/test_intake.py`` runs each on one queue and on several.

The order of a take is the same on any number of queues: the RQ lists, then the lanes,
higher priorities strictly first over all the queues, and batches of one priority in turn,
a job at a time, whichever of the queues they wait on (``lanes``).

Assumptions about RQ 3.0 (check them when upgrading): a queue's waiting ids are the list
``Queue.key`` (and, for mlxq's own submits, the queue's lanes: ``lanes``), its intermediate
list is ``Queue.intermediate_queue_key``, workers take from the left, and a job counts as
started only once it is in the started registry (which ``start_script`` writes, taking the
id out of the intermediate list in the same step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis
from rq.queue import Queue

from mlxq.broker import keys
from mlxq.broker.rq_store import lanes

# How long an idle worker blocks on its first queue's RQ list before it looks at every
# queue and lane again: Redis has no blocking move from several lists, so a job arriving
# anywhere else waits at most this long. A job on the first queue's list wakes it at once.
POLL_S = 0.25

# KEYS: n queues' RQ lists, their n intermediate lists, the 3n rotations of
# ``lanes.rotations`` (every queue's high, then normal, then low), then ``lanes.turns``.
# ARGV: 1 n, 2 how many ids at most. Takes the RQ lists first, in queue order; then, one
# priority at a time, a job at a time from the head lane (of the n rotations' heads) whose
# turn is oldest (ties: queue order), which goes to the back of its rotation with the next
# turn; a head lane found empty leaves its rotation and the turns. Per id: n LINDEX and n
# HGET (n is the worker's queues), never a scan of a lane.
# Returns {queue position (1-based), id, queue position, id, ...}.
_TAKE = """
local n, want, out = tonumber(ARGV[1]), tonumber(ARGV[2]), {}
local got, turns = 0, KEYS[5 * n + 1]
for i = 1, n do
  while got < want do
    local id = redis.call('LMOVE', KEYS[i], KEYS[n + i], 'LEFT', 'RIGHT')
    if not id then break end
    out[#out + 1] = i; out[#out + 1] = id; got = got + 1
  end
end
for p = 0, 2 do
  while got < want do
    local best, best_lane, best_turn = nil, nil, nil
    for i = 1, n do
      local lane = redis.call('LINDEX', KEYS[2 * n + p * n + i], 0)
      if lane then
        local turn = tonumber(redis.call('HGET', turns, lane) or 0)
        if not best or turn < best_turn then best, best_lane, best_turn = i, lane, turn end
      end
    end
    if not best then break end
    local rotation = KEYS[2 * n + p * n + best]
    local id = redis.call('LMOVE', best_lane, KEYS[n + best], 'LEFT', 'RIGHT')
    if id then
      out[#out + 1] = best; out[#out + 1] = id; got = got + 1
      redis.call('LMOVE', rotation, rotation, 'LEFT', 'RIGHT')
      redis.call('HSET', turns, best_lane, redis.call('HINCRBY', turns, '#', 1))
    else
      redis.call('LREM', rotation, 0, best_lane)
      redis.call('HDEL', turns, best_lane)
    end
  end
end
return out
"""


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def take(conn: redis.Redis, queues: Sequence[Queue], n: int) -> list[tuple[Queue, str]]:
    """Up to ``n`` waiting job ids of ``queues``, each moved into its queue's intermediate
    list, all in one server-side script: the queues' RQ lists first, in queue order, then
    their lanes by priority, equal batches in turn on all the queues together (``lanes``).
    """
    if n <= 0 or not queues:
        return []
    keys_ = [q.key for q in queues] + [q.intermediate_queue_key for q in queues]
    keys_ += [*lanes.rotations(q.name for q in queues), keys.lane_turns()]
    got = conn.register_script(_TAKE)(keys=keys_, args=[len(queues), n])  # sent once
    return [(queues[int(got[i]) - 1], _text(got[i + 1])) for i in range(0, len(got), 2)]


def move_first(conn: redis.Redis, queues: Sequence[Queue]) -> tuple[Queue, str] | None:
    """The first waiting job id in :func:`take`'s order, moved into its queue's
    intermediate list; None when nothing waits."""
    found = take(conn, queues, 1)
    return found[0] if found else None


def wait_move(
    conn: redis.Redis, queues: Sequence[Queue], timeout: float, poll_s: float = POLL_S
) -> tuple[Queue, str] | None:
    """Up to ``timeout`` seconds for a job id on any of ``queues`` (in :func:`take`'s
    order), moved into its queue's intermediate list; None if none came.

    Blocks on the first queue's RQ list ``poll_s`` at a time and looks at every list and
    lane in between (lanes fill without waking a blocked move).
    """
    deadline = time.monotonic() + timeout
    while True:
        found = move_first(conn, queues)
        if found is not None:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        head = queues[0]
        got = conn.blmove(head.key, head.intermediate_queue_key, max(min(poll_s, left), 0.01))
        if got is not None:
            return head, _text(got)


def move_many(conn: redis.Redis, queue: Queue, n: int) -> list[str]:
    """Up to ``n`` waiting ids of ``queue`` (its RQ list, then its lanes) moved into its
    intermediate list, in :func:`take`'s order, in one round trip."""
    return [job_id for _, job_id in take(conn, [queue], n)]


def drop_from_intermediate(conn: redis.Redis, queue: Queue, job_id: str) -> None:
    """Forget an id in ``queue``'s intermediate list whose job is gone (deleted while
    queued): there is nothing left to run or recover."""
    conn.lrem(queue.intermediate_queue_key, 1, job_id)
