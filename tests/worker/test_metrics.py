"""Worker metrics as Prometheus scrapes them: the real HTTP endpoint, parsed."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from mlxq.wire import Result, Timing, Usage
from mlxq.worker.metrics import MAX_FAILURE_REASONS, WorkerMetrics


@pytest.fixture
def metrics() -> Iterator[WorkerMetrics]:
    m = WorkerMetrics()
    m.serve(0, host="127.0.0.1")
    yield m
    m.stop()


def scrape(m: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics`` as {(name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def result(reason="length", prompt=10, completion=20, **timing) -> Result:
    return Result(
        job_id="j1",
        custom_id="c1",
        finish_reason=reason,
        text="x" * completion,
        usage=Usage(prompt, completion, prompt + completion),
        timing=Timing(**timing),
    )


def test_a_fresh_worker_exports_zeros(metrics):
    s = scrape(metrics)
    for outcome in ("stop", "length", "error", "cancelled", "timeout", "expired"):
        assert s[("mlxq_jobs_total", (("outcome", outcome),))] == 0
    assert s[("mlxq_generated_tokens_total", ())] == 0
    assert s[("mlxq_jobs_in_flight", ())] == 0
    assert s[("mlxq_time_to_first_token_seconds_count", ())] == 0


def test_finished_jobs_count_outcomes_tokens_and_timings(metrics):
    metrics.job_finished(
        result(
            "length",
            prompt=12,
            completion=64,
            started_at=100.0,
            finished_at=104.0,
            queue_wait_s=2.5,
            ttft_s=0.2,
            decode_tps=40.0,
            prefill_tps=900.0,
        )
    )
    metrics.job_finished(result("stop", prompt=8, completion=3, ttft_s=0.3))
    s = scrape(metrics)
    assert s[("mlxq_jobs_total", (("outcome", "length"),))] == 1
    assert s[("mlxq_jobs_total", (("outcome", "stop"),))] == 1
    assert s[("mlxq_prompt_tokens_total", ())] == 20
    assert s[("mlxq_generated_tokens_total", ())] == 67
    assert s[("mlxq_time_to_first_token_seconds_count", ())] == 2
    assert s[("mlxq_time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    assert s[("mlxq_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    # measurements a result lacks are not observed (the second had no queue wait)
    assert s[("mlxq_queue_wait_seconds_count", ())] == 1
    assert s[("mlxq_queue_wait_seconds_sum", ())] == 2.5
    assert s[("mlxq_generation_seconds_sum", ())] == 4.0
    assert s[("mlxq_decode_tokens_per_second_count", ())] == 1
    assert s[("mlxq_decode_tokens_per_second_bucket", (("le", "50.0"),))] == 1
    assert s[("mlxq_decode_tokens_per_second_bucket", (("le", "30.0"),))] == 0
    assert s[("mlxq_prefill_tokens_per_second_sum", ())] == 900.0


def test_failures_count_as_errors_by_reason(metrics):
    metrics.job_failed("rejected")
    metrics.job_failed("Prompt too long!")
    metrics.job_failed("prompt_too_long")
    s = scrape(metrics)
    assert s[("mlxq_jobs_total", (("outcome", "error"),))] == 3
    assert s[("mlxq_job_failures_total", (("reason", "rejected"),))] == 1
    assert s[("mlxq_job_failures_total", (("reason", "prompt_too_long"),))] == 2


def test_failure_reasons_are_bounded(metrics):
    for i in range(MAX_FAILURE_REASONS + 10):
        metrics.job_failed(f"reason {i}")
    s = scrape(metrics)
    reasons = [dict(labels)["reason"] for name, labels in s if name == "mlxq_job_failures_total"]
    assert len(reasons) == MAX_FAILURE_REASONS + 1
    assert s[("mlxq_job_failures_total", (("reason", "other"),))] == 10


def test_gauges_report_the_latest_state(metrics):
    metrics.set_in_flight(7)
    metrics.set_in_flight(5)
    metrics.set_queue_depth("default", 120)
    metrics.set_queue_depth("tiny", 3)
    metrics.set_memory(6 * 2**30, 9 * 2**30)
    metrics.set_kv(2 * 2**30, 8 * 2**30)
    metrics.set_info(worker="studio-1", model="models/tiny", backend="cpu")
    s = scrape(metrics)
    assert s[("mlxq_jobs_in_flight", ())] == 5
    assert s[("mlxq_queue_depth", (("queue", "default"),))] == 120
    assert s[("mlxq_queue_depth", (("queue", "tiny"),))] == 3
    assert s[("mlxq_memory_active_bytes", ())] == 6 * 2**30
    assert s[("mlxq_memory_peak_bytes", ())] == 9 * 2**30
    assert s[("mlxq_kv_reserved_bytes", ())] == 2 * 2**30
    assert s[("mlxq_kv_budget_bytes", ())] == 8 * 2**30
    info = (("backend", "cpu"), ("model", "models/tiny"), ("worker", "studio-1"))
    assert s[("mlxq_worker_info", info)] == 1


def test_recovered_jobs_count_by_how_a_sweep_found_them(metrics):
    assert scrape(metrics)[("mlxq_jobs_recovered_total", (("how", "unaccounted"),))] == 0
    metrics.jobs_recovered("unaccounted", 2)
    metrics.jobs_recovered("abandoned", 1)
    metrics.jobs_recovered("stranded", 0)
    s = scrape(metrics)
    assert s[("mlxq_jobs_recovered_total", (("how", "unaccounted"),))] == 2
    assert s[("mlxq_jobs_recovered_total", (("how", "abandoned"),))] == 1
    assert s[("mlxq_jobs_recovered_total", (("how", "stranded"),))] == 0


def test_every_metric_is_prefixed(metrics):
    names = {name for name, _ in scrape(metrics)}
    assert names and all(n.startswith("mlxq_") for n in names)


def test_instances_are_independent():
    a, b = WorkerMetrics(), WorkerMetrics()
    a.serve(0, host="127.0.0.1")
    b.serve(0, host="127.0.0.1")
    try:
        a.set_in_flight(3)
        a.job_finished(result(completion=5))
        assert a.port != b.port
        assert scrape(a)[("mlxq_generated_tokens_total", ())] == 5
        assert scrape(b)[("mlxq_generated_tokens_total", ())] == 0
        assert scrape(b)[("mlxq_jobs_in_flight", ())] == 0
    finally:
        a.stop()
        b.stop()


def test_serve_on_a_given_port_and_stop():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    m = WorkerMetrics()
    m.serve(port, host="127.0.0.1")
    try:
        assert m.port == port and scrape(m)
        with pytest.raises(RuntimeError, match="already served"):
            m.serve(port, host="127.0.0.1")
    finally:
        m.stop()
    m.stop()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_port_in_use_fails_loudly():
    m = WorkerMetrics()
    m.serve(0, host="127.0.0.1")
    try:
        with pytest.raises(OSError):
            WorkerMetrics().serve(m.port, host="127.0.0.1")
    finally:
        m.stop()
