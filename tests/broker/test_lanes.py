"""Priorities and fairness against a real Valkey: a batch's jobs wait in its lane of the
queue; a pull takes RQ's list first (put-back jobs), then lanes by priority, equal batches a
job at a time, on one queue and over all of a worker's queues; cancel drops lanes; every
sweep sees a lane's jobs as held."""

from __future__ import annotations

import json
import threading

import pytest
import redis
from rq.queue import Queue

from mlxq.broker import batches, fleet, intake, keys, unaccounted
from mlxq.broker.recovery import requeue_stranded
from mlxq.broker.rq_store import lanes, pull, reads, rq_keys, whereabouts
from mlxq.broker.serializer import serializer
from mlxq.wire import Request
from tests.helpers import dequeued, run_mlxq


def _batch(conn: redis.Redis, n: int, queue: str, priority: str = "normal") -> list[str]:
    reqs = [Request(prompt=f"p{i}", max_tokens=4) for i in range(n)]
    batch = batches.submit(conn, reqs, queue=queue, priority=priority).batch_id
    return batches.batch_job_ids(conn, batch)


def _queues(conn: redis.Redis, *names: str) -> list[Queue]:
    return [Queue(n, connection=conn, serializer=serializer) for n in names]


def _take(conn: redis.Redis, queues: list[Queue], n: int) -> list[str]:
    return [job_id for _, job_id in pull.take(conn, queues, n)]


def test_higher_priorities_are_taken_first_each_batch_in_input_order(conn):
    low = _batch(conn, 3, "prio", "low")
    normal = _batch(conn, 3, "prio")
    high = _batch(conn, 3, "prio", "high")
    queues = _queues(conn, "prio")
    assert _take(conn, queues, 4) == [*high, normal[0]]
    assert _take(conn, queues, 10) == [*normal[1:], *low]
    assert _take(conn, queues, 10) == []
    # every id went into the intermediate list, in the order taken
    moved = conn.lrange(queues[0].intermediate_queue_key, 0, -1)
    assert [i.decode() for i in moved] == [*high, *normal, *low]


def test_equal_batches_share_the_queue_a_job_at_a_time(conn):
    """A big batch first and a small one after: the small one's jobs are interleaved with
    the big one's, not behind all of them."""
    big = _batch(conn, 1200, "fair")  # more than one submit chunk
    small = _batch(conn, 5, "fair")
    queues = _queues(conn, "fair")
    first = _take(conn, queues, 10)
    assert first == [x for pair in zip(big[:5], small, strict=True) for x in pair]
    assert _take(conn, queues, 2000) == big[5:]
    # drained lanes leave their rotation
    assert conn.llen(keys.lanes("fair", "normal")) == 0


def test_a_put_back_job_comes_before_any_lane(conn):
    (pulled, *rest) = _batch(conn, 3, "back")
    queues = _queues(conn, "back")
    assert _take(conn, queues, 1) == [pulled]
    assert requeue_stranded(queues[0], 0, at_once=True) == [pulled]  # on RQ's own list
    high = _batch(conn, 2, "back", "high")
    assert _take(conn, queues, 10) == [pulled, *high, *rest]


def test_a_high_batch_on_a_later_queue_comes_before_normal_on_the_first(conn):
    normal = _batch(conn, 2, "model-q")
    high = _batch(conn, 2, "default-q", "high")
    queues = _queues(conn, "model-q", "default-q")
    taken = pull.take(conn, queues, 4)
    assert [(qu.name, j) for qu, j in taken] == [
        *[("default-q", j) for j in high],
        *[("model-q", j) for j in normal],
    ]


def _names(taken: list[tuple[Queue, str]]) -> list[str]:
    return [queue.name for queue, _ in taken]


def test_equal_batches_on_two_queues_take_turns_a_job_at_a_time(conn):
    """A worker on its model's queue and ``default``: a big batch on one and a small one
    on the other alternate, in one take and over pulls of one job, whichever came first
    and whichever queue the worker lists first; each id lands in its own queue's
    intermediate list."""
    big = _batch(conn, 1200, "model-q")  # more than one submit chunk
    queues = _queues(conn, "model-q", "default-q")
    assert _take(conn, queues, 3) == big[:3]  # the big one alone for a while
    small = _batch(conn, 4, "default-q")
    taken = pull.take(conn, queues, 6)
    assert [j for _, j in taken] == [small[0], big[3], small[1], big[4], small[2], big[5]]
    assert _names(taken) == ["default-q", "model-q"] * 3
    # a pull at a time (an idle worker's first look) keeps the turns
    assert [pull.move_first(conn, queues)[1] for _ in range(3)] == [small[3], big[6], big[7]]
    for queue, ids in zip(queues, (big[:8], small), strict=True):
        moved = conn.lrange(queue.intermediate_queue_key, 0, -1)
        assert [i.decode() for i in moved] == ids
    # listed the other way round, the same turns
    other = _batch(conn, 2, "default-q")
    assert _take(conn, queues[::-1], 4) == [other[0], big[8], other[1], big[9]]
    # drained lanes leave their rotations and the turns
    assert _take(conn, queues, 2000) == big[10:]
    assert conn.llen(keys.lanes("default-q", "normal")) == 0
    assert conn.llen(keys.lanes("model-q", "normal")) == 0
    assert conn.hkeys(keys.lane_turns()) == [b"#"]


def test_three_batches_on_two_queues_share_a_third_each(conn):
    """Turns are per batch, not per queue: two batches on one queue and one on the other
    get a job each in every round."""
    a, b = _batch(conn, 6, "model-q"), _batch(conn, 6, "model-q")
    c = _batch(conn, 6, "default-q")
    queues = _queues(conn, "model-q", "default-q")
    taken = _take(conn, queues, 9)
    assert sorted(taken) == sorted([*a[:3], *b[:3], *c[:3]])
    for i in range(3):  # every batch once in each round of three
        assert {taken[3 * i], taken[3 * i + 1], taken[3 * i + 2]} == {a[i], b[i], c[i]}


def test_a_higher_batch_on_the_second_queue_goes_before_turns_on_the_first(conn):
    """Priorities stay strict over the queues: a high batch on the later queue, submitted
    after an equal pair started sharing, takes every pull until it is done."""
    big = _batch(conn, 10, "model-q")
    other = _batch(conn, 10, "default-q")
    queues = _queues(conn, "model-q", "default-q")
    assert _take(conn, queues, 2) == [big[0], other[0]]
    high = _batch(conn, 3, "default-q", "high")
    low = _batch(conn, 2, "model-q", "low")
    assert _take(conn, queues, 7) == [*high, big[1], other[1], big[2], other[2]]
    assert _take(conn, queues, 100)[-2:] == low


def test_cancel_forgets_the_lanes_turns(conn):
    ids = _batch(conn, 3, "forget")
    _take(conn, _queues(conn, "forget"), 1)
    lane = keys.lane("forget", _batch_id(conn, ids[0]))
    assert conn.hexists(keys.lane_turns(), lane)
    assert batches.cancel_batch(conn, _batch_id(conn, ids[0])) == (3, 0)  # one taken, unstarted
    assert not conn.hexists(keys.lane_turns(), lane)


def test_an_idle_worker_on_one_queue_wakes_for_a_lane_job(conn):
    """The blocking wait is on the queue's RQ list; a lane filling meanwhile is found by the
    look between short blocks, not after the whole timeout."""
    queues = _queues(conn, "wake")
    ids: list[str] = []
    t = threading.Thread(target=lambda: ids.extend(_batch(conn, 1, "wake")))
    t.start()
    got = pull.wait_move(conn, queues, timeout=600, poll_s=0.05)
    t.join()
    assert got == (queues[0], ids[0])


def test_cancel_drops_the_batchs_lanes(conn):
    gone = _batch(conn, 4, "cancel", "high")
    kept = _batch(conn, 2, "cancel")
    batch = _batch_id(conn, gone[0])
    assert batches.cancel_batch(conn, batch) == (4, 0)
    assert not conn.exists(keys.lane("cancel", batch))
    assert conn.lrange(keys.lanes("cancel", "high"), 0, -1) == []
    assert lanes.waiting(conn, ["cancel"]) == {"cancel": 2}
    assert _take(conn, _queues(conn, "cancel"), 10) == kept


def _batch_id(conn: redis.Redis, job_id: str) -> str:
    batch_id = reads.batch_id_of(conn, job_id)
    assert batch_id is not None
    return batch_id


def test_a_cancelled_job_leaves_its_lane(conn):
    ids = _batch(conn, 3, "one")
    assert batches.cancel_jobs(conn, ids[1:2]) == (1, 0)
    assert conn.lrange(keys.lane("one", _batch_id(conn, ids[0])), 0, -1) == [
        i.encode() for i in (ids[0], ids[2])
    ]
    assert lanes.waiting(conn, ["one"]) == {"one": 2}


def test_a_cancelled_job_left_in_a_lane_is_dropped_when_pulled(conn):
    """A cancel that leaves the id in its lane (a batch's, before its lanes go): the pull
    drops it, and runs the rest."""
    _, worker, _ = dequeued(conn, 0, "drop")
    ids = _batch(conn, 2, "drop")
    assert batches.cancel_jobs(conn, ids[:1], from_lanes=False) == (1, 0)
    pulled = intake.dequeue_many(worker, 10)
    assert [job.id for job, _ in pulled] == ids  # the cancelled id is still in the lane
    started = intake.register(worker, pulled)
    assert isinstance(started[0], str) and not isinstance(started[1], str)
    assert conn.llen(_queues(conn, "drop")[0].intermediate_queue_key) == 0


def test_lane_jobs_are_held_so_no_sweep_puts_them_back(conn):
    """No false 'unaccounted': jobs waiting in lanes are counted and listed as held, and a
    sweep (however often, with no grace) moves none of them."""
    ids = _batch(conn, 30, "held-lanes") + _batch(conn, 3, "held-lanes", "low")
    assert whereabouts.holders_count(conn, "held-lanes") == 33
    assert whereabouts.held_ids(conn, "held-lanes") == set(ids)
    for _ in range(3):
        conn.delete(keys.audit_lock())
        assert unaccounted.sweep(conn, ["held-lanes"], 0, every_s=5) == []
    assert not conn.exists(keys.unaccounted("held-lanes"))
    assert not conn.exists(rq_keys.queue_key("held-lanes"))  # nothing pushed twice
    batch = _batch_id(conn, ids[0])
    for job_id in ids[:30]:  # asked directly, the lane is looked in too
        got = whereabouts.put_back_if_unheld(conn, job_id, "held-lanes", batch, 0)
        assert got == "held"
    assert unaccounted.find(conn, batch) == []


def test_a_priority_that_is_not_one_is_refused(conn):
    with pytest.raises(ValueError, match="priority: 'urgent' is not one of high, normal, low"):
        batches.submit(conn, [Request(prompt="x")], queue="bad-prio", priority="urgent")
    assert batches.get_batch(conn, batches.submit(conn, [Request(prompt="x")], queue="p").batch_id)


def test_status_shows_the_priority_and_queue_depth_counts_lanes(conn):
    info = batches.submit(conn, [Request(prompt="x")] * 3, queue="depth", priority="low")
    assert batches.get_batch(conn, info.batch_id).priority == "low"
    assert batches.batch_status(conn, info.batch_id).priority == "low"
    (row,) = [r for r in fleet.queue_overview(conn) if r.name == "depth"]
    assert row.queued == 3 and row.oldest_enqueued_at is not None


# -- where users set it: mlxq submit, the Python client, the OpenAI API's metadata ----------


def test_submit_and_the_client_set_the_priority_and_refuse_others(conn, valkey_url, tmp_path):
    from mlxq.client import Client

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x", "max_tokens": 2}\n')
    done = run_mlxq(
        "submit", str(path), "--queue", "cli-prio", "--priority", "high", "--json", url=valkey_url
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["priority"] == "high"
    bad = run_mlxq("submit", str(path), "--priority", "urgent", url=valkey_url)
    assert bad.returncode == 2 and "'urgent' is not one of 'high', 'normal', 'low'" in bad.stderr
    batch = json.loads(done.stdout)["batch_id"]
    again = run_mlxq("submit", str(path), "--resume", batch, "--priority", "low", url=valkey_url)
    assert again.returncode == 1 and "drop --priority" in again.stderr
    client = Client(valkey_url)
    assert client.submit([{"prompt": "y"}], queue="cli-prio", priority="low").priority == "low"
    with pytest.raises(ValueError, match="priority: 'soon' is not one of"):
        client.submit([{"prompt": "y"}], queue="cli-prio", priority="soon")
    assert lanes.waiting(conn, ["cli-prio"]) == {"cli-prio": 2}


def test_the_api_takes_the_priority_from_the_batchs_metadata(client, conn):
    import openai
    from api_servers import completion_line, create, upload

    file_id = upload(client, [completion_line("a", "Once")])
    made = create(client, file_id, metadata={"priority": "high", "job": "evals"})
    (info,) = [b for b in _batches(conn) if b.source == f"api:{made.id}"]
    assert info.priority == "high"
    with pytest.raises(openai.BadRequestError, match=r"metadata\.priority: 'now' is not one of"):
        create(client, file_id, metadata={"priority": "now"})


def _batches(conn: redis.Redis) -> list:
    return [batches.get_batch(conn, b.decode()) for b in conn.zrange(keys.batches(), 0, -1)]
