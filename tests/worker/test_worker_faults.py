"""The worker against bad and unlucky jobs: a bad-input corpus pushed past `mlxq submit`
(straight into RQ, as any producer on a shared Redis could), expiry, time limits, retries.
Every bad job fails alone with an error that names the problem; the good ones finish."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rq import Queue
from rq.job import Job

from mlxq.broker import batches, keys
from mlxq.broker.serializer import serializer
from mlxq.wire import Request
from mlxq.worker.launch import run_worker
from mlxq.worker.profile import WorkerProfile

BAD = Path(__file__).resolve().parents[1] / "data" / "inputs" / "bad"
CORPUS = [
    "out_of_range",
    "wrong_types",
    "missing_prompt",
    "empty_prompt",
    "both_prompt_and_messages",
    "unknown_fields",
    "negative_token_ids",
    "absurd_max_tokens",
]


@pytest.fixture
def profile(tiny_model) -> WorkerProfile:
    return WorkerProfile(model=tiny_model, max_batch=4, prefill_batch=2)


def _corpus_objects() -> list[dict]:
    objs = []
    for name in CORPUS:
        for line in (BAD / f"{name}.jsonl").read_text().splitlines():
            obj = json.loads(line) if line.strip() else None
            if isinstance(obj, dict) and "body" not in obj:
                objs.append(obj)
    return objs


def test_bad_requests_pushed_straight_into_rq_fail_alone(conn, profile):
    rq_queue = Queue("raw", connection=conn, serializer=serializer)
    bad = _corpus_objects()
    bad += [
        {"prompt": [1, 2, 99999]},
        {"prompt": "x " * 3000, "max_tokens": 8},
        {"prompt": "fine", "max_tokens": 100000},
    ]
    bad_jobs = [rq_queue.enqueue(keys.JOB_FUNC, obj) for obj in bad]
    good = rq_queue.enqueue(keys.JOB_FUNC, {"prompt": "A good one", "max_tokens": 5})
    assert len(bad_jobs) >= 20
    run_worker(profile, conn, burst=True, queues=["raw"])
    for job, obj in zip(bad_jobs, bad, strict=True):
        job = Job.fetch(job.id, connection=conn, serializer=serializer)
        assert job.get_status() == "failed", obj
        message = job.latest_result().exc_string
        assert message and "\n" not in message.strip() and len(message) < 600, obj
    assert Job.fetch(good.id, connection=conn, serializer=serializer).get_status() == "finished"


def test_expired_batch_requests_are_not_run(conn, profile):
    info = batches.submit(
        conn, [Request(prompt=f"p{i}", max_tokens=4) for i in range(3)], queue="exp", expires_in=1
    )
    time.sleep(1.2)
    run_worker(profile, conn, burst=True, queues=["exp"])
    results = list(batches.iter_batch_results(conn, info.batch_id))
    assert [r.finish_reason for r in results] == ["expired"] * 3
    assert all(r.token_ids == [] and "expired" in r.error for r in results)
    assert all(r.usage.prompt_tokens > 0 for r in results)  # tokenized when vetted
    assert batches.batch_status(conn, info.batch_id).failed == 3


def test_job_time_limit_stops_generation_with_partial_output(conn, profile):
    reqs = [Request(prompt=f"Long story {i}", max_tokens=1900) for i in range(4)]
    info = batches.submit(conn, reqs, queue="slow", job_timeout=1)
    run_worker(profile, conn, burst=True, queues=["slow"])
    results = list(batches.iter_batch_results(conn, info.batch_id))
    timed_out = [r for r in results if r.finish_reason == "timeout"]
    assert timed_out, [r.finish_reason for r in results]
    assert all("time limit" in r.error for r in timed_out)
    assert all(r.finish_reason in ("timeout", "stop", "length") for r in results)


def test_a_job_refused_for_its_length_reports_its_prompt_tokens(conn, profile):
    """Refused at vetting once tokenized: the failed result's usage counts its prompt."""
    info = batches.submit(conn, [Request(prompt=[5] * 30, max_tokens=2040)], queue="long")
    run_worker(profile, conn, burst=True, queues=["long"])
    (failed,) = list(batches.iter_batch_results(conn, info.batch_id))
    assert failed.finish_reason == "error" and "but the context of" in failed.error
    assert failed.usage.prompt_tokens == 30 and failed.usage.completion_tokens == 0


def test_retries_then_failed_and_mlxq_retry_requeues(conn, profile):
    info = batches.submit(conn, [Request(prompt=[1, 99999], max_tokens=3)], queue="rt", retries=2)
    job_id = batches.batch_job_ids(conn, info.batch_id)[0]
    run_worker(profile, conn, burst=True, queues=["rt"])
    job = Job.fetch(job_id, connection=conn, serializer=serializer)
    assert job.get_status() == "failed" and job.retries_left == 0
    assert batches.retry_failed(conn, [job_id]) == 1
    assert Job.fetch(job_id, connection=conn, serializer=serializer).get_status() == "queued"
    assert conn.lrange("rq:queue:rt", 0, -1) == [job_id.encode()]


def test_results_of_jobs_that_never_generated_keep_their_prompt_tokens(conn):
    """A failed, expired or refused job whose prompt was tokenized reports its prompt tokens
    (usage), not 0: the engine's count where it has one, else the one vetting made."""
    from mlxq.broker.intake import register
    from mlxq.broker.rq_store.transitions import result_without_output
    from mlxq.wire import JobMeta, Usage
    from mlxq.worker.outcomes import InFlight, unrun_result
    from tests.helpers import dequeued

    _, worker, group = dequeued(conn, 1, "usage")
    (execution,) = register(worker, group)
    (job, queue), request = group[0], Request(prompt="four tokens or so")
    inf = InFlight(job, queue, execution, request, JobMeta(), time.time(), prompt_tokens=5)
    assert unrun_result(inf, "expired", "late", "m", "w").usage == Usage(5, 0, 5)
    refused = result_without_output(job, "error", "too long", prompt_tokens=9)
    assert refused.usage == Usage(9, 0, 9)
