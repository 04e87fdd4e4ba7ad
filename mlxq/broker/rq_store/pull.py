"""Taking job ids off RQ queues into RQ's intermediate lists: never out of every list.

RQ 3.0's own dequeue (``Queue.dequeue_any``) moves an id into the queue's intermediate
list (``BLMOVE``) only when a worker listens on one queue; on several it pops with
``BLPOP``, and the popped id sits in no list until the job is registered. A worker that
dies (or a start that is refused) in between loses the job for good. mlxq therefore never
calls RQ's dequeue: every pull here is a move (``LMOVE``/``BLMOVE``, left of the queue to
the right of its intermediate list, as RQ's one-queue path does), so from the moment an id
leaves its queue it is in a list that ``recovery.requeue_stranded`` sweeps.

Assumptions about RQ 3.0 (check them when upgrading): a queue's waiting ids are the list
``Queue.key``, its intermediate list is ``Queue.intermediate_queue_key``, workers take from
the left, and a job counts as started only once it is in the started registry (which
``start_script`` writes, taking the id out of the intermediate list in the same step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis
from rq.queue import Queue

# How long an idle worker on several queues blocks on its first queue before it looks at
# all of them again: Redis has no blocking move from several lists, so a job arriving on a
# later queue waits at most this long. A job on the first queue (the model's) wakes it at once.
POLL_S = 0.25

# KEYS: queue 1, its intermediate list, queue 2, its intermediate list, ... in dequeue
# order. Returns {position of the queue (1-based), job id}, or nil when all are empty.
_MOVE_FIRST = """
for i = 1, #KEYS, 2 do
  local id = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'LEFT', 'RIGHT')
  if id then return {(i + 1) / 2, id} end
end
return nil
"""


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def move_first(conn: redis.Redis, queues: Sequence[Queue]) -> tuple[Queue, str] | None:
    """The first waiting job id of the first non-empty queue, moved into that queue's
    intermediate list in one atomic step; None when every queue is empty."""
    keys_: list[str] = []
    for queue in queues:
        keys_ += [queue.key, queue.intermediate_queue_key]
    got = conn.register_script(_MOVE_FIRST)(keys=keys_)  # EVALSHA: the script is sent once
    if not got:
        return None
    return queues[int(got[0]) - 1], _text(got[1])


def wait_move(
    conn: redis.Redis, queues: Sequence[Queue], timeout: float, poll_s: float = POLL_S
) -> tuple[Queue, str] | None:
    """Up to ``timeout`` seconds for a job id on any of ``queues`` (in their order), moved
    into its queue's intermediate list; None if none came.

    One queue blocks on it (``BLMOVE``) for the whole wait; several block on the first for
    ``poll_s`` at a time and look at all of them in between.
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
        block = left if len(queues) == 1 else min(poll_s, left)
        got = conn.blmove(head.key, head.intermediate_queue_key, max(block, 0.01))
        if got is not None:
            return head, _text(got)


def move_many(conn: redis.Redis, queue: Queue, n: int) -> list[str]:
    """Up to ``n`` waiting ids of ``queue`` moved into its intermediate list, in order, in
    one round trip."""
    with conn.pipeline(transaction=False) as pipe:
        for _ in range(n):
            pipe.lmove(queue.key, queue.intermediate_queue_key)
        return [_text(i) for i in pipe.execute() if i is not None]


def drop_from_intermediate(conn: redis.Redis, queue: Queue, job_id: str) -> None:
    """Forget an id in ``queue``'s intermediate list whose job is gone (deleted while
    queued): there is nothing left to run or recover."""
    conn.lrem(queue.intermediate_queue_key, 1, job_id)
