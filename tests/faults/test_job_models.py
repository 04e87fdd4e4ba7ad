"""A job runs only on the model it names, however it reached the queue: a service in another
language writes RQ jobs straight into Redis, onto a queue whose long-lived worker serves
another model. It is failed with a reason that says what to do (never answered by the wrong
model), or, for a worker that serves the named model too, moved to that model's queue and
run there."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import redis
from rq.job import Job
from rq.queue import Queue

from mlxq.broker import keys
from mlxq.broker.rq_store import rq_keys
from mlxq.broker.serializer import serializer
from mlxq.wire import Result
from tests.helpers import Worker

pytestmark = pytest.mark.slow


def _enqueue(conn: redis.Redis, queue: str, body: dict) -> str:
    """A job written as a producer using RQ directly writes it (no `mlxq submit`)."""
    return Queue(queue, connection=conn, serializer=serializer).enqueue(keys.JOB_FUNC, body).id


def _ended(conn: redis.Redis, job_ids: list[str], timeout: float = 120) -> dict[str, Job]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = {j: Job.fetch(j, connection=conn, serializer=serializer) for j in job_ids}
        if all(job.get_status() in ("finished", "failed") for job in jobs.values()):
            return jobs
        assert time.monotonic() < deadline, {j: job.get_status() for j, job in jobs.items()}
        time.sleep(0.2)


def _result(conn: redis.Redis, job_id: str) -> Result:
    """The job's one result (exactly one entry in its results stream)."""
    assert conn.xlen(rq_keys.results_key(job_id)) == 1
    job = Job.fetch(job_id, connection=conn, serializer=serializer)
    return msgspec.convert(job.latest_result().return_value, Result)


def test_a_job_naming_another_model_is_failed_not_run_on_this_one(start, conn, tiny_model):
    start()  # serves `tiny` and `default`, long-lived
    other = _enqueue(conn, "default", {"prompt": "Hello", "max_tokens": 4, "model": "org/other"})
    mine = [
        _enqueue(conn, "default", {"prompt": "Hello", "max_tokens": 4, **named})
        for named in ({}, {"model": "tiny"}, {"model": tiny_model}, {"model": "org/tiny"})
    ]
    jobs = _ended(conn, [other, *mine])
    assert jobs[other].get_status() == "failed"
    result = _result(conn, other)
    assert result.finish_reason == "error" and result.usage.completion_tokens == 0
    assert "names model 'org/other'" in result.error and "queue 'default'" in result.error
    assert "\n" not in result.error
    for job_id in mine:  # no model, or this model by any of its names: run here
        assert jobs[job_id].get_status() == "finished"
        result = _result(conn, job_id)
        assert result.model == tiny_model and result.error is None


def test_a_worker_of_two_models_moves_a_job_to_the_model_it_names(
    two_models: tuple[str, str], valkey_url: str, conn: redis.Redis, tmp_path: Path
):
    alpha, beta = two_models
    worker = Worker(valkey_url, alpha, "--model", beta, log=tmp_path / "w.log")
    try:
        worker.wait_listening(conn)
        on_alpha = _enqueue(conn, "alpha", {"prompt": "Hi", "max_tokens": 4, "model": "beta"})
        on_default = _enqueue(conn, "default", {"prompt": "Hi", "max_tokens": 4, "model": beta})
        plain = _enqueue(conn, "alpha", {"prompt": "Hi", "max_tokens": 4})
        jobs = _ended(conn, [on_alpha, on_default, plain])
        assert {j: job.get_status() for j, job in jobs.items()} == dict.fromkeys(
            [on_alpha, on_default, plain], "finished"
        ), worker.log.read_text()
        assert _result(conn, on_alpha).model == beta
        assert _result(conn, on_default).model == beta
        assert _result(conn, plain).model == alpha
        assert jobs[on_alpha].origin == "beta"
    finally:
        worker.stop()
