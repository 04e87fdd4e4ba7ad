"""The sweep for jobs that a batch owns, that wait or run by their status, and that no list
or registry holds: marked once, put back once, never touched while held."""

from __future__ import annotations

import json

import redis
from rq.job import Job

from mlxq.broker import batches, keys, unaccounted
from mlxq.broker.intake import register
from mlxq.broker.rq_store import rq_keys
from mlxq.wire import Request
from tests.helpers import dequeued, run_mlxq


def _sweep(conn: redis.Redis, queue: str, grace_s: float = 0) -> list[str]:
    conn.delete(keys.audit_lock())  # as if a sweep interval went by
    return unaccounted.sweep(conn, [queue], grace_s, every_s=5)


def test_held_jobs_are_never_touched(conn):
    """Waiting, pulled and started jobs are all held: no marks, nothing moved."""
    batch, worker, group = dequeued(conn, 2, "held")
    register(worker, group[:1])  # one started, one pulled
    batches.submit(conn, [Request(prompt="w")], queue="held")  # and one waiting
    for _ in range(2):
        assert _sweep(conn, "held") == []
    assert not conn.exists(keys.unaccounted("held"))
    assert unaccounted.find(conn, batch) == []


def test_a_job_removed_from_every_list_is_put_back_once(conn):
    batch = batches.submit(conn, [Request(prompt=f"p{i}") for i in range(3)], queue="lost").batch_id
    lost = batches.batch_job_ids(conn, batch)[1]
    conn.lrem(keys.lane("lost", batch), 1, lost)  # by hand, or by a path mlxq does not know
    assert unaccounted.find(conn, batch) == [lost]
    assert _sweep(conn, "lost", grace_s=3600) == []  # marked; within its grace
    assert conn.hexists(keys.unaccounted("lost"), lost)
    assert _sweep(conn, "lost", grace_s=0) == [lost]
    assert _sweep(conn, "lost", grace_s=0) == []  # once
    # back on the queue's RQ list (taken before any lane); the others still in their lane
    assert conn.lrange(rq_keys.queue_key("lost"), 0, -1) == [lost.encode()]
    ids = [i.decode() for i in conn.lrange(keys.lane("lost", batch), 0, -1)]
    assert sorted([*ids, lost]) == sorted(batches.batch_job_ids(conn, batch))
    assert not conn.hexists(keys.unaccounted("lost"), lost)
    assert unaccounted.find(conn, batch) == []


def test_a_started_job_that_lost_its_registry_entry_goes_back_queued(conn):
    batch, worker, group = dequeued(conn, 1, "started")
    (execution,) = register(worker, group)
    job = group[0][0]
    conn.zrem(rq_keys.started_key("started"), execution.composite_key)
    assert _sweep(conn, "started") == []
    assert _sweep(conn, "started") == [job.id]
    assert Job.fetch(job.id, connection=conn).get_status() == "queued"
    status = batches.batch_status(conn, batch)
    assert (status.queued, status.started) == (1, 0), status


def test_a_job_found_held_again_loses_its_mark(conn):
    """Marked while out of every list, then back in one before its grace ran out: the mark
    goes, so a later disappearance starts its grace afresh."""
    batch = batches.submit(conn, [Request(prompt="p")], queue="back").batch_id
    (job_id,) = batches.batch_job_ids(conn, batch)
    conn.lrem(keys.lane("back", batch), 1, job_id)
    _sweep(conn, "back", grace_s=3600)
    conn.rpush(keys.lane("back", batch), job_id)
    assert _sweep(conn, "back", grace_s=0) == []
    assert not conn.exists(keys.unaccounted("back"))
    assert conn.llen(keys.lane("back", batch)) == 1 and not conn.exists(rq_keys.queue_key("back"))


def test_one_worker_of_the_fleet_sweeps_per_interval(conn):
    batch = batches.submit(conn, [Request(prompt="p")], queue="lock").batch_id
    (job_id,) = batches.batch_job_ids(conn, batch)
    conn.lrem(keys.lane("lock", batch), 1, job_id)
    unaccounted.sweep(conn, ["lock"], 0, every_s=60)  # marks, takes the lock
    assert unaccounted.sweep(conn, ["lock"], 0, every_s=60) == []  # another worker: skipped
    assert _sweep(conn, "lock") == [job_id]


def test_status_json_reports_unaccounted_jobs(conn, valkey_url):
    batch = batches.submit(conn, [Request(prompt=f"p{i}") for i in range(2)], queue="st").batch_id
    lost = batches.batch_job_ids(conn, batch)[0]
    done = run_mlxq("status", batch, "--json", url=valkey_url)
    assert done.returncode == 0 and "unaccounted" not in json.loads(done.stdout)
    conn.lrem(keys.lane("st", batch), 1, lost)
    done = run_mlxq("status", batch, "--json", url=valkey_url)
    assert json.loads(done.stdout)["unaccounted"] == [lost]
    human = run_mlxq("status", batch, url=valkey_url).stdout
    assert "1 jobs wait or run by their status but no queue or registry holds them" in human
