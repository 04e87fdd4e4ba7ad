"""Batch counters against a real Valkey and a real worker: exact through retries, cancels,
expiry and `mlxq retry`, and equal to the jobs counted one by one. Every ended job carries
one full Result. Only the ``rq_store`` package names RQ's keys."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mlxq.broker import batches
from mlxq.broker.rq_store import rq_keys, states
from mlxq.broker.rq_store.counters import read_counts
from mlxq.wire import Request
from mlxq.worker.launch import run_worker
from mlxq.worker.profile import WorkerProfile
from tests.helpers import waiting

PACKAGE = Path(__file__).resolve().parents[2] / "mlxq"
RQ_STORE = PACKAGE / "broker" / "rq_store"


@pytest.fixture
def profile(tiny_model) -> WorkerProfile:
    return WorkerProfile(model=tiny_model, max_batch=4, prefill_batch=2)


def counters(conn, batch_id: str) -> dict[str, int]:
    return read_counts(conn.hgetall(f"mlxq:batch:{batch_id}:counts"))


def test_only_rq_store_spells_rq_keys():
    spelled = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if RQ_STORE not in p.parents and "rq:" in p.read_text()
    ]
    assert spelled == []


def test_retries_failures_and_retry_keep_counts_exact(conn, profile):
    reqs = [
        Request(prompt="fine", max_tokens=3, custom_id="ok"),
        Request(prompt=[1, 99999], max_tokens=3, custom_id="bad"),  # token id out of range
    ]
    info = batches.submit(conn, reqs, queue="cnt", retries=2)
    run_worker(profile, conn, burst=True, queues=["cnt"])
    want = dict.fromkeys(states.BUCKETS, 0) | {"finished": 1, "failed": 1}
    assert counters(conn, info.batch_id) == batches.count_jobs(conn, info.batch_id) == want
    ok, bad = batches.iter_batch_results(conn, info.batch_id)
    # A failure stores the same full Result as a success: who ran it, when, and why.
    assert bad.finish_reason == "error" and "99999" in bad.error
    assert bad.worker and bad.worker == ok.worker and bad.model == profile.model
    assert bad.custom_id == "bad" and bad.index == 1 and bad.batch_id == info.batch_id
    assert bad.timing.enqueued_at and bad.timing.started_at
    assert batches.retry_failed(conn, batches.batch_job_ids(conn, info.batch_id)) == 1
    s = batches.batch_status(conn, info.batch_id)
    assert (s.queued, s.finished, s.failed) == (1, 1, 0)
    assert batches.retry_failed(conn, batches.batch_job_ids(conn, info.batch_id)) == 0  # not twice


def test_cancelled_and_expired_jobs_count_and_store_full_results(conn, profile):
    cancelled = batches.submit(conn, [Request(prompt=f"c{i}", custom_id=f"c{i}") for i in range(5)])
    assert batches.cancel_batch(conn, cancelled.batch_id) == (5, 0)
    assert batches.cancel_batch(conn, cancelled.batch_id) == (0, 0)  # nothing left to cancel
    s = batches.batch_status(conn, cancelled.batch_id)
    assert (s.queued, s.cancelled, s.done) == (0, 5, 5)
    assert counters(conn, cancelled.batch_id) == batches.count_jobs(conn, cancelled.batch_id)
    results = list(batches.iter_batch_results(conn, cancelled.batch_id))
    assert [r.custom_id for r in results] == [f"c{i}" for i in range(5)]
    assert all(r.finish_reason == "cancelled" and r.timing.enqueued_at for r in results)
    assert waiting(conn, "default") == 0

    reqs = [Request(prompt=f"e{i}", max_tokens=3) for i in range(3)]
    expired = batches.submit(conn, reqs, queue="exp", expires_in=1)
    time.sleep(1.1)
    run_worker(profile, conn, burst=True, queues=["exp"])
    s = batches.batch_status(conn, expired.batch_id)
    assert (s.expired, s.failed, s.done, s.started) == (3, 3, 3, 0)
    assert counters(conn, expired.batch_id)["expired"] == 3


def test_status_is_read_from_counters_not_jobs(conn):
    info = batches.submit(conn, [Request(prompt=f"p{i}") for i in range(2500)], queue="big")
    # Counters, not the jobs, are what status reads: a job's hash deleted behind mlxq's
    # back does not change it (counting job by job would call it expired).
    conn.delete(rq_keys.job_key(batches.batch_job_ids(conn, info.batch_id)[0]))
    s = batches.batch_status(conn, info.batch_id)
    assert (s.total, s.queued, s.enqueued, s.state) == (2500, 2500, 2500, "submitted")
    assert batches.count_jobs(conn, info.batch_id)["expired"] == 1


def test_results_stream_in_input_order_across_chunks(conn, profile):
    n = 2 * batches.CHUNK + 7
    info = batches.submit(conn, [Request(prompt=f"r{i}", custom_id=f"r{i}") for i in range(n)])
    batches.cancel_batch(conn, info.batch_id)
    stream = batches.iter_batch_results(conn, info.batch_id)
    assert next(stream).custom_id == "r0"  # a generator: nothing read past the first chunk
    rest = [r.custom_id for r in stream]
    assert rest == [f"r{i}" for i in range(1, n)]


def test_resume_refuses_other_requests_and_a_live_submit(conn):
    reqs = [Request(prompt=f"p{i}") for i in range(3)]
    info = batches.submit(conn, reqs)
    with pytest.raises(batches.ResumeRefused, match="not the ones batch"):
        batches.resume(conn, info.batch_id, reqs[:2])
    again, before = batches.resume(conn, info.batch_id, reqs)  # complete: nothing more to do
    assert before == 3 and batches.batch_status(conn, info.batch_id).queued == 3
    assert again.state == "submitted" and not conn.exists(f"mlxq:batch:{info.batch_id}:submitting")
    conn.set(f"mlxq:batch:{info.batch_id}:submitting", "pid 1 on elsewhere")
    with pytest.raises(batches.ResumeRefused, match="still being submitted by pid 1 on elsewhere"):
        batches.resume(conn, info.batch_id, reqs)


def test_resume_keeps_the_batchs_own_settings(tmp_path):
    from tests.helpers import run_mlxq

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    out = run_mlxq("submit", str(prompts), "--resume", "b1", "--queue", "q", "--retries", "2")
    assert out.returncode == 1
    assert "--resume keeps the batch's own settings; drop --queue, --retries" in out.stderr
