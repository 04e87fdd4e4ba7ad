"""The worker in-process against a real Valkey: bad jobs fail alone, hostile jobs never run."""

from __future__ import annotations

import os
import signal
import time

import pytest
from rq import Queue
from rq.job import Job

from mlxq.broker import batches
from mlxq.broker.serializer import serializer
from mlxq.wire import Request
from mlxq.worker.launch import run_worker
from mlxq.worker.profile import WorkerProfile
from tests.helpers import waiting


@pytest.fixture
def profile(tiny_model) -> WorkerProfile:
    return WorkerProfile(model=tiny_model, max_batch=4, prefill_batch=2, abandon_after=6)


def test_bad_jobs_fail_alone_and_the_rest_finish(conn, profile):
    reqs = [
        Request(prompt="A fine prompt", max_tokens=6, custom_id="ok-1"),
        Request(prompt=[1, 2, 10**9], max_tokens=6, custom_id="bad-ids"),
        Request(prompt="x " * 5000, max_tokens=6, custom_id="too-long"),
        Request(prompt="Another fine prompt", max_tokens=6, custom_id="ok-2"),
    ]
    info = batches.submit(conn, reqs, queue="wq")
    run_worker(profile, conn, burst=True, queues=["wq"])
    results = list(batches.iter_batch_results(conn, info.batch_id))
    by_id = {r.custom_id: r for r in results}
    assert by_id["ok-1"].finish_reason in ("stop", "length") and by_id["ok-1"].token_ids
    assert by_id["ok-2"].finish_reason in ("stop", "length")
    assert by_id["bad-ids"].finish_reason == "error" and "vocab" in by_id["bad-ids"].error.lower()
    assert by_id["too-long"].finish_reason == "error"
    assert "context" in by_id["too-long"].error
    s = batches.batch_status(conn, info.batch_id)
    assert (s.finished, s.failed) == (2, 2)
    failed = Queue("wq", connection=conn, serializer=serializer).failed_job_registry
    assert failed.count == 2


def test_hostile_jobs_fail_without_running_anything(conn, profile, tmp_path):
    marker = tmp_path / "pwned"
    pickled = Queue("evil", connection=conn).enqueue(os.system, f"touch {marker}")
    named = Queue("evil", connection=conn, serializer=serializer).enqueue(
        "os.system", f"touch {marker}"
    )
    run_worker(profile, conn, burst=True, queues=["evil"])
    assert not marker.exists()
    for job_id, reason in (
        (pickled.id, "a Python pickle, which mlxq never loads"),
        (named.id, "only run mlxq.jobs.generate"),
    ):
        job = Job.fetch(job_id, connection=conn, serializer=serializer)
        assert job.get_status() == "failed"
        assert reason in job.latest_result().exc_string


def test_worker_registers_with_rq_and_finishes_jobs_through_rq(conn, profile):
    info = batches.submit(
        conn, [Request(prompt=f"p{i}", max_tokens=5) for i in range(10)], queue="wq"
    )
    worker = run_worker(profile, conn, burst=True, queues=["wq"])
    worker.refresh()
    assert worker.successful_job_count == 10 and worker.jobs_done == 10
    ids = batches.batch_job_ids(conn, info.batch_id)
    job = Job.fetch(ids[3], connection=conn, serializer=serializer)
    assert job.get_status() == "finished"
    rv = job.return_value()
    assert rv["job_id"] == ids[3] and rv["batch_id"] == info.batch_id and rv["index"] == 3
    queue = Queue("wq", connection=conn, serializer=serializer)
    assert queue.started_job_registry.count == 0
    # RQ's own readers see what its worker would have written.
    assert sorted(queue.finished_job_registry.get_job_ids()) == sorted(ids)
    assert job.ended_at is not None and job.started_at <= job.ended_at
    assert job.worker_name == worker.name and job.is_finished
    assert worker.failed_job_count == 0 and worker.total_working_time > 0


def test_python_client_submits_waits_and_fetches_one(conn, profile, valkey_url):
    from mlxq.client import Client

    client = Client(valkey_url)
    batch = client.submit(
        [{"prompt": "Hello", "max_tokens": 4, "custom_id": "h1"}, Request(prompt="Bye")],
        queue="cq",
    )
    job_id = client.submit_one({"prompt": "Solo", "max_tokens": 3}, queue="cq")
    assert client.result(job_id, timeout=0) is None
    assert client.status(batch.batch_id).queued == 2
    run_worker(profile, conn, burst=True, queues=["cq"])
    results = client.wait(batch.batch_id, timeout=5)
    assert [r.custom_id for r in results] == ["h1", None]
    assert results[1].usage.completion_tokens > 0
    one = client.result(job_id, timeout=5)
    assert one is not None and one.job_id == job_id and len(one.token_ids) <= 3


def test_client_rejects_invalid_requests_before_enqueueing(conn, valkey_url):
    from mlxq.client import Client

    with pytest.raises(ValueError, match=r"request 1: .*max_tokens"):
        Client(valkey_url).submit([{"prompt": "ok"}, {"prompt": "x", "max_tokens": 0}], queue="cq")
    assert waiting(conn, "cq") == 0


def test_client_takes_openai_batch_lines(conn, valkey_url):
    from mlxq.client import Client

    line = {
        "custom_id": "oa",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "Hi", "max_tokens": 5},
    }
    batch = Client(valkey_url).submit([line], queue="cq")
    job = Job.fetch(
        batches.batch_job_ids(conn, batch.batch_id)[0], connection=conn, serializer=serializer
    )
    assert job.args[0]["prompt"] == "Hi" and job.args[0]["max_tokens"] == 5


def test_worker_publishes_itself_and_serves_metrics(conn, profile):
    import urllib.request

    import msgspec
    from prometheus_client.parser import text_string_to_metric_families

    from mlxq.broker import fleet

    seen = []
    prof = msgspec.structs.replace(profile, metrics_port=0, name="pub-1")
    batches.submit(conn, [Request(prompt=f"p{i}", max_tokens=4) for i in range(6)], queue="mq")

    def on_finish(result):
        seen.extend(fleet.live_workers(conn))

    worker = run_worker(prof, conn, burst=True, queues=["mq"], on_finish=on_finish)
    assert seen and seen[0].name == "pub-1" and seen[0].model == prof.model
    assert seen[0].queues == ["mq"] and seen[0].max_batch == 4 and seen[0].kv_budget_bytes > 0
    assert fleet.live_workers(conn) == []  # a clean exit drops it at once
    port = worker.reporter.metrics.port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    finished = sum(v for (n, labels), v in samples.items() if n == "mlxq_jobs_total")
    assert finished == 6
    worker.reporter.metrics.stop()


def test_a_signal_while_the_worker_starts_stops_it_like_any_other(conn, profile, monkeypatch):
    # `mlxq run` interrupted as it starts: the signal lands while the worker subscribes to
    # RQ's command channel. It stops the worker as a signal does later (no KeyboardInterrupt,
    # nothing taken), and the channel's thread does not outlive it.
    from mlxq.worker.rq_worker import MlxqWorker

    info = batches.submit(conn, [Request(prompt="p", max_tokens=4)], queue="sigq")
    subscribe = MlxqWorker.subscribe

    def subscribe_then_signal(self: MlxqWorker) -> None:
        subscribe(self)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # (the handler runs here)

    monkeypatch.setattr(MlxqWorker, "subscribe", subscribe_then_signal)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        worker = run_worker(profile, conn, burst=True, queues=["sigq"])
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert worker.pubsub_thread is not None and not worker.pubsub_thread.is_alive()
    assert batches.batch_status(conn, info.batch_id).queued == 1
