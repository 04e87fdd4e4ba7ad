"""Queue I/O against a real Valkey: batches as RQ jobs, status, results, no pickle."""

from __future__ import annotations

import base64
import json

import msgspec
import pytest
from rq.job import Job

from mlxq.broker import batches as q
from mlxq.broker import keys
from mlxq.broker.rq_store import counters, lanes, rq_keys, states
from mlxq.broker.serializer import serializer
from mlxq.wire import Request, Result


def _reqs(n: int) -> list[Request]:
    return [Request(prompt=f"p{i}", custom_id=f"c{i}", max_tokens=4) for i in range(n)]


def test_submit_makes_one_rq_job_per_request_in_order(conn):
    info = q.submit(conn, _reqs(2500), queue="qa")
    ids = q.batch_job_ids(conn, info.batch_id)
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
    info = q.submit(conn, _reqs(1), queue="qa")
    jid = q.batch_job_ids(conn, info.batch_id)[0]
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
    info = q.submit(conn, _reqs(4), queue="qa")
    ids = q.batch_job_ids(conn, info.batch_id)
    _set_state(conn, ids[0], info.batch_id, "finished")
    _set_state(conn, ids[1], info.batch_id, "failed")
    _set_state(conn, ids[2], info.batch_id, "started")
    s = q.batch_status(conn, info.batch_id)
    assert q.count_jobs(conn, info.batch_id) == {
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
    with pytest.raises(q.BatchNotFound, match="check the id"):
        q.batch_status(conn, "bnope")


def test_results_decode_return_values_and_failures_in_input_order(conn):
    info = q.submit(conn, _reqs(3), queue="qa")
    ids = q.batch_job_ids(conn, info.batch_id)
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
    got = list(q.iter_batch_results(conn, info.batch_id))
    assert got[0] == ok
    assert got[1].finish_reason == "error" and got[1].error == "JobRejected: prompt too long"
    assert got[1].custom_id == "c1" and got[1].index == 1
    assert got[2] is None


def test_wait_times_out_with_a_hint(conn):
    info = q.submit(conn, _reqs(1), queue="qa")
    with pytest.raises(TimeoutError, match="is a worker running on queue 'qa'"):
        q.wait_for_batch(conn, info.batch_id, timeout=0.3, poll=0.1)


def test_two_cancels_racing_over_the_same_jobs_each_settle(conn, monkeypatch):
    """`mlxq cancel` and an API poll may cancel one batch at once: the one that comes second
    finds the jobs cancelled between its read and its write, and looks again (RQ's own
    cancel refuses a cancelled job)."""
    batch = q.submit(conn, _reqs(3), queue="race").batch_id
    fetch_many = Job.fetch_many
    racing = []

    def fetch_then_race(*args, **kwargs):
        jobs = fetch_many(*args, **kwargs)
        if not racing:  # the other canceller's whole cancel lands right after this read
            racing.append(True)
            assert q.cancel_batch(conn, batch, stop_running=False) is not None
        return jobs

    monkeypatch.setattr(Job, "fetch_many", staticmethod(fetch_then_race))
    q.cancel_batch(conn, batch, stop_running=False)
    status = q.batch_status(conn, batch)
    assert (status.cancelled, status.queued, status.total) == (3, 0, 3), status
    results = list(q.iter_batch_results(conn, batch))
    assert [r.finish_reason for r in results] == ["cancelled"] * 3
    assert [conn.xlen(rq_keys.results_key(r.job_id)) for r in results] == [1, 1, 1]
