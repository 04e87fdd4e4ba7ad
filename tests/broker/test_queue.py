"""Queue I/O against a real Valkey: batches as RQ jobs, status, results, no pickle."""

from __future__ import annotations

import base64
import json
import time
from types import SimpleNamespace

import msgspec
import pytest
from rq.job import Job

from mlxq.broker import batches, keys
from mlxq.broker.intake import register
from mlxq.broker.rq_store import (
    cancel_retry,
    counters,
    lanes,
    pull,
    rq_keys,
    start_script,
    states,
    transitions,
)
from mlxq.broker.serializer import serializer
from mlxq.wire import JobMeta, Request, Result
from mlxq.worker import watchdog
from mlxq.worker.outcomes import InFlight
from tests.helpers import dequeued


def _reqs(n: int) -> list[Request]:
    return [Request(prompt=f"p{i}", custom_id=f"c{i}", max_tokens=4) for i in range(n)]


def test_submit_makes_one_rq_job_per_request_in_order(conn):
    info = batches.submit(conn, _reqs(2500), queue="qa")
    ids = batches.batch_job_ids(conn, info.batch_id)
    assert len(ids) == 2500 and len(set(ids)) == 2500
    # waiting on the batch's lane of the queue, in input order (not on RQ's list)
    assert conn.lrange(keys.lane("qa", info.batch_id), 0, -1) == [i.encode() for i in ids]
    assert lanes.waiting(conn, ["qa"]) == {"qa": 2500}
    job = Job.fetch(ids[7], connection=conn, serializer=serializer)
    assert job.func_name == keys.JOB_FUNC
    assert job.args[0]["prompt"] == "p7" and job.args[0]["custom_id"] == "c7"
    assert job.meta == {"batch_id": info.batch_id, "index": 7, "custom_id": "c7"}
    assert job.result_ttl == keys.DEFAULT_RESULT_TTL


def test_job_data_in_redis_is_json_not_pickle(conn):
    info = batches.submit(conn, _reqs(1), queue="qa")
    jid = batches.batch_job_ids(conn, info.batch_id)[0]
    raw = conn.hget(f"rq:job:{jid}", "data")
    import zlib

    data = json.loads(zlib.decompress(raw))
    assert data[0] == keys.JOB_FUNC and data[2][0]["prompt"] == "p0"


def _set_state(conn, job_id: str, batch_id: str, status: str) -> None:
    """A job's RQ status changed as every mlxq transition does: with its batch counter."""
    with conn.pipeline() as pipe:
        counters.move(pipe, job_id, batch_id, states.BUCKET_OF_STATUS[status])
        pipe.hset(rq_keys.job_key(job_id), "status", status)
        pipe.execute()


def test_status_counts_by_state(conn):
    info = batches.submit(conn, _reqs(4), queue="qa")
    ids = batches.batch_job_ids(conn, info.batch_id)
    _set_state(conn, ids[0], info.batch_id, "finished")
    _set_state(conn, ids[1], info.batch_id, "failed")
    _set_state(conn, ids[2], info.batch_id, "started")
    s = batches.batch_status(conn, info.batch_id)
    assert batches.count_jobs(conn, info.batch_id) == {
        "queued": 1,
        "started": 1,
        "finished": 1,
        "failed": 1,
        "cancelled": 0,
        "expired": 0,
    }
    assert (s.total, s.queued, s.started, s.finished, s.failed) == (4, 1, 1, 1, 1)
    assert s.done == 2


def test_unknown_batch_says_what_to_check(conn):
    with pytest.raises(batches.BatchNotFound, match="check the id"):
        batches.batch_status(conn, "bnope")


def test_results_decode_return_values_and_failures_in_input_order(conn):
    info = batches.submit(conn, _reqs(3), queue="qa")
    ids = batches.batch_job_ids(conn, info.batch_id)
    ok = Result(job_id=ids[0], custom_id="c0", finish_reason="length", text="hi", token_ids=[1])
    conn.hset(f"rq:job:{ids[0]}", "status", "finished")
    conn.xadd(
        f"rq:results:{ids[0]}",
        {
            "type": 1,
            "return_value": base64.b64encode(serializer.dumps(msgspec.to_builtins(ok))).decode(),
        },
    )
    job = Job.fetch(ids[1], connection=conn, serializer=serializer)
    with conn.pipeline() as pipe:
        job.set_status("failed", pipeline=pipe)
        job._handle_failure("Traceback...\nJobRejected: prompt too long", pipe)
        pipe.execute()
    got = list(batches.iter_batch_results(conn, info.batch_id))
    assert got[0] == ok
    assert got[1].finish_reason == "error" and got[1].error == "JobRejected: prompt too long"
    assert got[1].custom_id == "c1" and got[1].index == 1
    assert got[2] is None


def test_wait_times_out_with_a_hint(conn):
    info = batches.submit(conn, _reqs(1), queue="qa")
    with pytest.raises(TimeoutError, match="is a worker running on queue 'qa'"):
        batches.wait_for_batch(conn, info.batch_id, timeout=0.3, poll=0.1)


def test_two_cancels_racing_over_the_same_jobs_each_settle(conn, monkeypatch):
    """`mlxq cancel` and the API may cancel one batch at once: the one that comes second
    finds the jobs cancelled between its read and its write; each job's script checks its
    status in the step that ends it, so each is cancelled once, and nothing is retried."""
    batch = batches.submit(conn, _reqs(3), queue="race").batch_id
    fetch_many = Job.fetch_many
    racing = []

    def fetch_then_race(*args, **kwargs):
        jobs = fetch_many(*args, **kwargs)
        if not racing:  # the other canceller's whole cancel lands right after this read
            racing.append(True)
            assert batches.cancel_batch(conn, batch, stop_running=False) is not None
        return jobs

    monkeypatch.setattr(Job, "fetch_many", staticmethod(fetch_then_race))
    batches.cancel_batch(conn, batch, stop_running=False)
    status = batches.batch_status(conn, batch)
    assert (status.cancelled, status.queued, status.total) == (3, 0, 3), status
    results = list(batches.iter_batch_results(conn, batch))
    assert [r.finish_reason for r in results] == ["cancelled"] * 3
    assert [conn.xlen(rq_keys.results_key(r.job_id)) for r in results] == [1, 1, 1]


# -- a batch's cancel: its first step, and the script that ends each waiting job ---------


def _rotation_lanes(conn, queue: str) -> set[bytes]:
    return {lane for r in lanes.rotations([queue]) for lane in conn.lrange(r, 0, -1)}


def test_the_first_step_flags_the_batch_marks_its_record_and_drops_its_lanes(conn):
    gone = batches.submit(conn, _reqs(4), queue="mk", priority="high").batch_id
    kept = batches.submit(conn, _reqs(3), queue="mk").batch_id
    queue = batches.make_queue(conn, "mk")
    assert len(pull.take(conn, [queue], 1)) == 1  # (a turn, as a worker's take leaves it)
    lane = keys.lane("mk", gone)
    assert conn.hexists(keys.lane_turns(), lane) and lane.encode() in _rotation_lanes(conn, "mk")

    batches.mark_cancelled(conn, gone)
    assert conn.get(keys.batch_cancelled(gone)) == b"stop"
    assert 0 < conn.ttl(keys.batch_cancelled(gone)) <= keys.BATCH_TTL
    assert batches.get_batch(conn, gone).state == "cancelled" and batches.batch_cancelled(
        conn, gone
    )
    assert conn.ttl(keys.batch_info(gone)) > 0  # (its record keeps its expiry)
    assert not conn.exists(lane, keys.batch_lanes(gone))
    assert not conn.hexists(keys.lane_turns(), lane)
    assert _rotation_lanes(conn, "mk") == {keys.lane("mk", kept).encode()}
    # nothing of it is taken any more; its jobs wait for the second step, uncounted yet
    taken = [j for _, j in pull.take(conn, [queue], 10)]
    assert taken == batches.batch_job_ids(conn, kept)
    assert batches.batch_status(conn, gone).queued == 4
    assert batches.get_batch(conn, kept).state == "submitted" and not batches.batch_cancelled(
        conn, kept
    )


def test_the_first_step_is_idempotent_and_a_drain_never_lowers_a_stop(conn):
    stop = batches.submit(conn, _reqs(1), queue="mk").batch_id
    drain = batches.submit(conn, _reqs(1), queue="mk").batch_id
    batches.mark_cancelled(conn, stop)
    batches.mark_cancelled(conn, stop, stop_running=False)
    batches.mark_cancelled(conn, drain, stop_running=False)
    assert conn.get(keys.batch_cancelled(drain)) == b"drain"
    batches.mark_cancelled(conn, drain)
    assert [conn.get(keys.batch_cancelled(b)) for b in (stop, drain)] == [b"stop", b"stop"]
    assert {batches.get_batch(conn, b).state for b in (stop, drain)} == {"cancelled"}


def test_the_first_step_writes_the_record_only_as_it_read_it(conn):
    """A submit that writes the record between the read and the script (its last chunk,
    then ``submitted``): the script flags the batch and drops its lanes all the same, leaves
    the record, and says so; ``mark_cancelled`` reads it again."""
    batch = batches.submit(conn, _reqs(2), queue="mk").batch_id
    raw = conn.get(keys.batch_info(batch))
    stale = raw.replace(b'"state":"submitted"', b'"state":"submitting"')
    lane_keys, queues = lanes.drop_keys(conn, batch)
    script = conn.register_script(cancel_retry._MARK)
    keys_ = [keys.batch_cancelled(batch), keys.batch_info(batch), *lane_keys]
    assert script(keys=keys_, args=["stop", 60, stale, b"{}", *queues]) == [0, 0]
    assert conn.get(keys.batch_info(batch)) == raw
    assert batches.batch_cancelled(conn, batch) and not conn.exists(keys.lane("mk", batch))
    batches.mark_cancelled(conn, batch)
    assert batches.get_batch(conn, batch).state == "cancelled"


def test_a_cancelled_job_is_left_as_rq_and_mlxqs_own_cancel_left_it(conn):
    """The script writes what RQ's ``Job.cancel`` and ``transitions.end_job`` wrote for a
    job cancelled while waiting: status, end time, result, registry, expiries, counter."""
    ours, theirs = batches.batch_job_ids(conn, batches.submit(conn, _reqs(2), queue="cx").batch_id)
    assert cancel_retry.cancel_now(conn, [ours]) == (1, 0)
    job = Job.fetch(theirs, connection=conn, serializer=serializer)
    queue = batches.make_queue(conn, "cx")
    with conn.pipeline() as pipe:
        pipe.watch(job.key)
        pipe.multi()
        job.cancel(pipeline=pipe)
        pipe.lrem(keys.lane("cx", job.meta["batch_id"]), 1, job.id)
        result = transitions.result_without_output(job, "cancelled", "cancelled before it started")
        transitions.end_job(pipe, job, queue, result)
        pipe.execute()

    def state(jid: str) -> dict:
        hash_ = conn.hgetall(rq_keys.job_key(jid))
        ((_, entry),) = conn.xrange(rq_keys.results_key(jid))
        value = json.loads(base64.b64decode(entry.pop(b"return_value")))
        value.pop("job_id")
        value["timing"].pop("enqueued_at")
        value.update(custom_id=None, index=None)
        return {
            "fields": sorted(hash_),
            "status": hash_[b"status"],
            "mlxq_state": hash_[b"mlxq_state"],
            "ttl": round(conn.ttl(rq_keys.job_key(jid)), -1),
            "result fields": sorted(entry),
            "result type": entry[b"type"],
            "result ttl": round(conn.ttl(rq_keys.results_key(jid)), -1),
            "result": value,
            "canceled": conn.zscore(queue.canceled_job_registry.key, jid) is not None,
            "in a list": conn.lpos(keys.lane("cx", value["batch_id"]), jid),
        }

    assert state(ours) == state(theirs)
    assert state(ours)["status"] == b"canceled"
    assert Job.fetch(ours, connection=conn, serializer=serializer).get_status() == "canceled"
    s = batches.batch_status(conn, job.meta["batch_id"])
    assert (s.cancelled, s.queued) == (2, 0)


def test_cancelling_is_idempotent_and_leaves_running_jobs_to_their_flag(conn):
    batch, worker, group = dequeued(conn, 4, "run")
    register(worker, group[:1])  # one started; three taken or waiting
    running = group[0][0].id
    conn.rpush(batches.make_queue(conn, "run").key, group[3][0].id)  # (as a sweep puts one back)
    conn.lrem(batches.make_queue(conn, "run").intermediate_queue_key, 1, group[3][0].id)
    assert batches.cancel_batch(conn, batch) == (3, 1)
    assert batches.cancel_batch(conn, batch) == (0, 1)
    assert batches.cancel_batch(conn, batch, stop_running=False) == (0, 0)
    assert conn.get(keys.batch_cancelled(batch)) == b"stop"
    ids = batches.batch_job_ids(conn, batch)
    assert [conn.xlen(rq_keys.results_key(j)) for j in ids] == [0, 1, 1, 1]
    assert conn.lrange(batches.make_queue(conn, "run").key, 0, -1) == []
    assert not list(conn.scan_iter(keys.cancel_flag("*")))  # the batch's flag covers them
    s = batches.batch_status(conn, batch)
    assert (s.cancelled, s.started, s.queued, s.state) == (3, 1, 0, "cancelled"), s
    # the two taken by the worker are refused at their start: nothing starts, nothing twice
    assert register(worker, group[1:3]) == [start_script.REFUSED[-2]] * 2
    assert conn.lrange(batches.make_queue(conn, "run").intermediate_queue_key, 0, -1) == []
    assert running in ids


def test_a_single_running_jobs_flag_lasts_no_longer_than_the_job_can_run(conn):
    _, worker, group = dequeued(conn, 2, "one")
    register(worker, group[:1])
    job = group[0][0]
    assert batches.cancel_jobs(conn, [job.id, group[1][0].id]) == (1, 1)
    assert 0 < conn.ttl(keys.cancel_flag(job.id)) <= keys.DEFAULT_JOB_TIMEOUT + 60
    assert not conn.exists(keys.cancel_flag(group[1][0].id))


class _Runner:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, key: str) -> None:
        self.cancelled.append(key)


def _inflight(job_id: str, batch_id: str | None) -> InFlight:
    job = SimpleNamespace(id=job_id, timeout=3600)
    return InFlight(job, None, None, None, JobMeta(batch_id=batch_id), time.time())  # type: ignore[arg-type]


def test_a_worker_stops_the_running_jobs_of_a_batch_cancelled_with_stop(conn):
    inflight = {
        j: _inflight(j, b)
        for j, b in [("a1", "A"), ("a2", "A"), ("d1", "D"), ("k1", "K"), ("x", None), ("f", "K")]
    }
    conn.set(keys.batch_cancelled("A"), "stop")
    conn.set(keys.batch_cancelled("D"), "drain")  # (an expiring API batch: they finish)
    conn.set(keys.cancel_flag("f"), 1)  # `mlxq cancel JOB`
    runner = _Runner()
    watchdog.stop_due(conn, inflight, runner)  # type: ignore[arg-type]
    assert runner.cancelled == ["a1", "a2", "f"]
    assert {j for j, inf in inflight.items() if inf.stop_reason == "cancelled"} == {"a1", "a2", "f"}
    watchdog.stop_due(conn, inflight, runner)  # type: ignore[arg-type]
    assert runner.cancelled == ["a1", "a2", "f"]  # each stopped once
