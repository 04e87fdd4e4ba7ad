"""Jobs another producer wrote badly, straight into Redis, among good ones: each bad job
fails alone with its reason, the good ones all run once, and the long-lived worker serving
them never goes down. And a job taken out of every list by hand comes back by the sweep."""

from __future__ import annotations

import pickle
import signal
import time
import zlib

import pytest
import redis

from mlxq.broker import batches, keys
from mlxq.broker.rq_store import rq_keys
from mlxq.wire import Request
from tests.helpers import waiting

pytestmark = pytest.mark.slow

# Fields of a good job's hash, each overwritten with something RQ cannot read.
BAD_FIELDS = {
    "created_at": b"yesterday",
    "enqueued_at": b"2026-13-45",
    "timeout": b"forever",
    "status": b"bogus",
    "result_ttl": b"a week",
    "retries_left": b"many",
    "dependency_ids": b"{not json",
    "data": zlib.compress(b"\0" * (9 * 1024 * 1024)),  # inflates past --max-job-bytes
}
# Payloads that RQ reads but mlxq refuses.
BAD_PAYLOADS = {
    "pickle": zlib.compress(pickle.dumps(("os.system", None, ["true"], {}))),
    "nan": zlib.compress(
        b'["mlxq.jobs.generate", null, [{"prompt": "p", "temperature": NaN}], {}]'
    ),
}


# Metas RQ reads, but not as mlxq's: a wrong type, and bytes that are not JSON.
BAD_METAS = (b'{"batch_id": 5}', b"\x80not json")


def _wait_ended(conn: redis.Redis, ids: list[str], worker) -> None:
    deadline = time.monotonic() + 120
    while any(s not in ("finished", "failed") for s in batches.job_states(conn, ids)):
        assert worker.proc.poll() is None, worker.log.read_text()
        assert time.monotonic() < deadline, dict(
            zip(ids, batches.job_states(conn, ids), strict=True)
        )
        time.sleep(0.2)


def test_bad_jobs_fail_alone_and_the_worker_carries_on(start, conn):
    reqs = [Request(prompt=f"Line {i}:", max_tokens=3, custom_id=f"c{i}") for i in range(24)]
    batch = batches.submit(conn, reqs, queue="hostile").batch_id
    ids = batches.batch_job_ids(conn, batch)
    good, bad = ids[0::2], ids[1::2]  # each bad job between two good ones
    writes = [(f, v) for f, v in BAD_FIELDS.items()] + [("data", v) for v in BAD_PAYLOADS.values()]
    writes += [("meta", m) for m in BAD_METAS]
    for job_id, (field, value) in zip(bad, writes, strict=True):
        conn.hset(rq_keys.job_key(job_id), field, value)
    worker = start("-q", "hostile")
    _wait_ended(conn, ids, worker)
    assert worker.proc.poll() is None  # still serving
    assert [conn.xlen(rq_keys.results_key(j)) for j in ids] == [1] * len(ids)
    results = dict(zip(ids, batches.fetch_results(conn, ids), strict=True))
    assert all(results[j].finish_reason in ("stop", "length") for j in good)
    assert all(results[j].finish_reason == "error" for j in bad)
    errors = {field: results[j].error for (field, _), j in zip(writes, bad, strict=True)}
    for field in ("created_at", "enqueued_at", "timeout", "status", "result_ttl", "retries_left"):
        assert errors[field].startswith("RQ cannot read the job's hash"), errors[field]
    reasons = [results[j].error for j in bad[len(BAD_FIELDS) - 1 :]]
    assert "--max-job-bytes" in reasons[0]
    assert "a Python pickle, which mlxq never loads" in reasons[1]
    assert "JSON has no NaN" in reasons[2]
    assert "invalid job meta: Expected `str | null`, got `int` - at `$.batch_id`" in reasons[3]
    assert "invalid job meta: not JSON" in reasons[4]
    assert waiting(conn, "hostile") == 0
    assert "Traceback" not in worker.stop()


def test_a_job_taken_out_of_every_list_by_hand_comes_back(start, conn):
    """With the worker stopped (SIGSTOP), a job of a batch is removed from its queue; once
    the worker runs again its sweep finds it held by nothing and puts it back, once."""
    worker = start("-q", "byhand", "--abandon-after", "3")
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        reqs = [Request(prompt=f"p{i}", max_tokens=2, custom_id=f"c{i}") for i in range(3)]
        batch = batches.submit(conn, reqs, queue="byhand").batch_id
        lost = batches.batch_job_ids(conn, batch)[1]
        conn.lrem(keys.lane("byhand", batch), 1, lost)
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    removed = time.monotonic()
    status = batches.wait_for_batch(conn, batch, timeout=120)
    took = time.monotonic() - removed
    assert (status.finished, status.queued, status.started) == (3, 0, 0), status
    assert [conn.xlen(rq_keys.results_key(j)) for j in batches.batch_job_ids(conn, batch)] == [
        1
    ] * 3
    log = worker.stop()
    assert f"job {lost} of batch {batch}" in log and "put it back on byhand" in log
    # --abandon-after (3 s) and the sweeps on either side of it (5 s apart), with room for
    # a loaded machine; the exact figure goes to the log of the test run.
    print(f"back and finished {took:.1f}s after it was removed")
    assert took < 3 + 2 * 5 + 30, took
