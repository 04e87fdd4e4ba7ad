"""Each path a pull can take moves the job id into its queue's intermediate list: one queue
(blocking move), several (a move over all of them; a blocking move on the first, a look at
the others between), a queue that fills while the worker waits, and the non-blocking pull
of many; for ids on RQ's lists and in batches' lanes alike. An id is never out of every
list."""

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


def _lane_batch(conn: redis.Redis, n: int, queue: str, priority: str = "normal") -> list[str]:
    from mlxq.broker import batches
    from mlxq.wire import Request

    reqs = [Request(prompt=f"p{i}", max_tokens=2) for i in range(n)]
    return batches.batch_job_ids(
        conn, batches.submit(conn, reqs, queue=queue, priority=priority).batch_id
    )


@pytest.mark.parametrize("names", [("one",), ("a", "b"), ("a", "b", "c")])
def test_lane_ids_move_into_their_queues_intermediate_lists(conn, names):
    """Jobs of submitted batches (in lanes, not RQ's lists) on one queue or several: every
    path of a pull (the take of many, the first look, the wait) leaves each id in its own
    queue's intermediate list, and the batches take turns over all the queues."""
    queues = _queues(conn, *names)
    ids = {q.name: _lane_batch(conn, 3, q.name) for q in queues}
    taken = pull.take(conn, queues, len(queues))  # a job of each batch, in queue order
    assert [(q.name, j) for q, j in taken] == [(q.name, ids[q.name][0]) for q in queues]
    first = pull.move_first(conn, queues)
    assert first == (queues[0], ids[queues[0].name][1])
    waited = pull.wait_move(conn, queues, timeout=1)
    if len(queues) == 1:
        assert waited == (queues[0], ids[queues[0].name][2])
    else:  # the second queue's batch: its turn is older than the first's
        assert waited == (queues[1], ids[queues[1].name][1])
    rest = pull.take(conn, queues, 100)
    everything = [*taken, first, waited, *rest]
    assert sorted(j for _, j in everything) == sorted(j for v in ids.values() for j in v)
    for q in queues:
        mine = [j for qu, j in everything if qu is q]
        assert _lists(conn, q) == ([], [j.encode() for j in mine])
        assert mine == ids[q.name]  # each batch in input order


@pytest.mark.parametrize("names", [("one",), ("a", "b")])
def test_dequeue_many_keeps_the_turns_across_queues(conn, names):
    """The worker's non-blocking pull loads jobs a queue at a time but hands them on in the
    order taken (the engine admits them in that order)."""
    from mlxq.broker import intake
    from mlxq.worker.rq_worker import MlxqWorker

    queues = _queues(conn, *names)
    ids = {q.name: _lane_batch(conn, 4, q.name) for q in queues}
    worker = MlxqWorker(list(names), connection=conn, runner=None, model_name="m")  # type: ignore[arg-type]
    worker.register_birth()
    pulled = intake.dequeue_many(worker, 8)
    order = [j for i in range(4) for j in (ids[q.name][i] for q in queues)][:8]
    assert [job.id for job, _ in pulled] == order
    assert [queue.name for _, queue in pulled] == [n for _ in range(4) for n in names][:8]
    for q in queues:
        assert _lists(conn, q)[1] == [j.encode() for j in order if j in ids[q.name]]


@pytest.mark.parametrize("names,target", [(("one",), 0), (("a", "b"), 1)])
def test_a_lane_filling_while_the_worker_waits_is_moved(conn, names, target):
    """No blocking move wakes for a lane: the look between short blocks finds it, on the
    first queue or a later one."""
    queues = _queues(conn, *names)
    ids: list[str] = []
    t = threading.Thread(target=lambda: ids.extend(_lane_batch(conn, 1, names[target])))
    t.start()
    got = pull.wait_move(conn, queues, timeout=30, poll_s=0.05)
    t.join()
    assert got == (queues[target], ids[0])
    assert _lists(conn, queues[target]) == ([], [ids[0].encode()])
