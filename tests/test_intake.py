"""Each path a pull can take moves the job id into its queue's intermediate list: one queue
(blocking move), several (a move over all of them; a blocking move on the first, a look at
the others between), a queue that fills while the worker waits, and the non-blocking pull
of many. An id is never out of every list."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from rq.queue import Queue

from mlxq.broker.rq_store import pull
from mlxq.broker.serializer import serializer


def _queues(conn: redis.Redis, *names: str) -> list[Queue]:
    return [Queue(n, connection=conn, serializer=serializer) for n in names]


def _lists(conn: redis.Redis, queue: Queue) -> tuple[list[bytes], list[bytes]]:
    return conn.lrange(queue.key, 0, -1), conn.lrange(queue.intermediate_queue_key, 0, -1)


@pytest.mark.parametrize("names", [("one",), ("a", "b"), ("a", "b", "c")])
def test_a_waiting_id_moves_into_the_intermediate_list_in_queue_order(conn, names):
    queues = _queues(conn, *names)
    for q in reversed(queues):  # every queue holds one id; the first queue's comes first
        conn.rpush(q.key, f"id-{q.name}")
    for q in queues:
        got = pull.wait_move(conn, queues, timeout=1)
        assert got is not None and got[0].name == q.name and got[1] == f"id-{q.name}"
        assert _lists(conn, q) == ([], [f"id-{q.name}".encode()])
    assert pull.wait_move(conn, queues, timeout=0.3) is None


@pytest.mark.parametrize("names,target", [(("one",), 0), (("a", "b"), 0), (("a", "b", "c"), 2)])
def test_an_id_arriving_while_the_worker_waits_is_moved(conn, names, target):
    """The first queue wakes the blocking move; a later queue is found by the next look."""
    queues = _queues(conn, *names)
    pushed = threading.Event()

    def push() -> None:
        pushed.wait()
        conn.rpush(queues[target].key, "late")

    t = threading.Thread(target=push)
    t.start()
    pushed.set()
    got = pull.wait_move(conn, queues, timeout=30, poll_s=0.05)
    t.join()
    assert got is not None and got == (queues[target], "late")
    assert _lists(conn, queues[target]) == ([], [b"late"])


def test_wait_gives_up_after_its_timeout(conn):
    queues = _queues(conn, "x", "y")
    start = time.monotonic()
    assert pull.wait_move(conn, queues, timeout=0.3, poll_s=0.1) is None
    assert time.monotonic() - start >= 0.3


def test_move_many_keeps_order_and_moves_at_most_n(conn):
    (queue,) = _queues(conn, "many")
    conn.rpush(queue.key, *[f"j{i}" for i in range(5)])
    assert pull.move_many(conn, queue, 3) == ["j0", "j1", "j2"]
    assert _lists(conn, queue) == ([b"j3", b"j4"], [b"j0", b"j1", b"j2"])
    assert pull.move_many(conn, queue, 10) == ["j3", "j4"]
    assert pull.move_many(conn, queue, 10) == []
