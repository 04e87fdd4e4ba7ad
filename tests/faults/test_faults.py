"""Faults injected for real: worker processes killed and stopped by signals, Redis
restarted under load. Every test checks the books: each job has exactly one result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from mlxq.broker import batches
from mlxq.broker.rq_store import pull, rq_keys
from mlxq.server import make_server
from mlxq.wire import Request
from tests.helpers import wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def start_worker(url: str, model: str, *args: str, name: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "mlxq",
        "worker",
        "--model",
        model,
        "-q",
        "faults",
        "--max-batch",
        "4",
        "--prefill-batch",
        "2",
        "--name",
        name,
        *args,
    ]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "MLXQ_REDIS_URL": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def submit(conn: redis.Redis, n: int, max_tokens: int) -> str:
    reqs = [
        Request(prompt=f"Story {i}:", max_tokens=max_tokens, custom_id=f"r{i}") for i in range(n)
    ]
    return batches.submit(conn, reqs, queue="faults").batch_id


def assert_books_balance(conn: redis.Redis, batch_id: str, n: int) -> list:
    """Every job done exactly once: one result per job, all finished, none twice."""
    status = batches.batch_status(conn, batch_id)
    assert (status.total, status.finished, status.failed, status.queued, status.started) == (
        n,
        n,
        0,
        0,
        0,
    ), status
    # The counters, kept through every requeue, agree with the jobs counted one by one.
    counted = batches.count_jobs(conn, batch_id)
    assert counted["finished"] == n and counted["queued"] == counted["started"] == 0, counted
    ids = batches.batch_job_ids(conn, batch_id)
    assert [conn.xlen(rq_keys.results_key(j)) for j in ids] == [1] * n
    results = list(batches.iter_batch_results(conn, batch_id))
    assert [r.custom_id for r in results] == [f"r{i}" for i in range(n)]
    return results


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> str:
    proc.send_signal(sig)
    return proc.communicate(timeout=timeout)[0]


def test_killed_worker_jobs_complete_on_another_worker(tiny_model, valkey_url, conn):
    batch = submit(conn, 8, max_tokens=600)
    a = start_worker(valkey_url, tiny_model, "--abandon-after", "3", name="doomed")
    wait_until(lambda: batches.batch_status(conn, batch).started > 0, 120, "worker A to start jobs")
    a.kill()  # SIGKILL: no chance to put anything back
    a.wait()
    held = batches.batch_status(conn, batch).started
    assert held > 0
    killed_at = time.monotonic()
    b = start_worker(valkey_url, tiny_model, "--abandon-after", "3", name="rescuer")
    try:
        wait_until(lambda: batches.batch_status(conn, batch).done == 8, 180, "the batch to finish")
        recovery_s = time.monotonic() - killed_at
    except AssertionError as e:
        raise AssertionError(f"{e}: {batches.batch_status(conn, batch)}\n{stop(b)}") from e
    out = stop(b)
    assert b.returncode == 0, out
    results = assert_books_balance(conn, batch, 8)
    assert {r.worker for r in results} <= {"doomed", "rescuer"}
    assert recovery_s < 60, recovery_s
    print(f"recovered {held} jobs of a SIGKILLed worker in {recovery_s:.1f}s")


def test_jobs_dequeued_by_a_worker_that_died_before_registering_them_still_run(
    tiny_model, valkey_url, conn
):
    """A worker moves ids to RQ's intermediate queue, then registers them; one killed in
    between (or cut off from Redis) leaves them there, still ``queued``."""
    batch = submit(conn, 6, max_tokens=20)
    queue = batches.make_queue(conn, "faults")
    for _ in range(2):  # as a worker pulls: from the batch's lane into the intermediate list
        assert pull.move_first(conn, [queue]) is not None
    b = start_worker(valkey_url, tiny_model, "--abandon-after", "3", name="sweeper")
    try:
        wait_until(lambda: batches.batch_status(conn, batch).done == 6, 120, "the batch to finish")
    except AssertionError as e:
        raise AssertionError(f"{e}: {batches.batch_status(conn, batch)}\n{stop(b)}") from e
    out = stop(b)
    assert b.returncode == 0, out
    assert_books_balance(conn, batch, 6)
    assert conn.llen(queue.intermediate_queue_key) == 0
    assert out.count("stranded before it was registered") == 2, out


def test_sigterm_finishes_or_puts_back_and_exits_zero(tiny_model, valkey_url, conn):
    batch = submit(conn, 8, max_tokens=2000)
    a = start_worker(valkey_url, tiny_model, "--grace-period", "1", name="stopper")
    wait_until(lambda: batches.batch_status(conn, batch).started > 0, 120, "jobs to start")
    out = stop(a, signal.SIGTERM)
    assert a.returncode == 0, out
    s = batches.batch_status(conn, batch)
    assert s.started == 0 and s.queued + s.finished == 8, s
    assert "put job" in out  # the 1 s grace was too short for 2000-token jobs
    b = start_worker(valkey_url, tiny_model, "--burst", name="finisher")
    out_b = b.communicate(timeout=300)[0]
    assert b.returncode == 0, out_b
    assert_books_balance(conn, batch, 8)


def test_second_signal_stops_at_once_still_putting_jobs_back(tiny_model, valkey_url, conn):
    batch = submit(conn, 4, max_tokens=1800)
    a = start_worker(valkey_url, tiny_model, "--grace-period", "120", name="impatient")
    wait_until(lambda: batches.batch_status(conn, batch).started > 0, 120, "jobs to start")
    a.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    start = time.monotonic()
    out = stop(a, signal.SIGINT)
    assert time.monotonic() - start < 30 and a.returncode == 0, out
    s = batches.batch_status(conn, batch)
    assert s.started == 0 and s.queued + s.finished == 4, s


def test_redis_restart_mid_batch_loses_nothing(tiny_model, tmp_path):
    server = make_server(data_dir=tmp_path / "data", persist=True)
    server.start()
    port = server.port
    url = f"redis://127.0.0.1:{port}/0"
    conn = redis.Redis.from_url(url)
    batch = submit(conn, 10, max_tokens=300)
    w = start_worker(url, tiny_model, name="survivor")
    waiter = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxq",
            "results",
            batch,
            "--wait",
            "--timeout",
            "240",
            "-o",
            str(tmp_path / "out.jsonl"),
            "--redis-url",
            url,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: batches.batch_status(conn, batch).finished > 0, 120, "first results")
        server.stop()  # SIGTERM: Valkey writes its append-only file and exits
        time.sleep(2)
        server = make_server(port=port, data_dir=tmp_path / "data", persist=True)
        server.start()
        out = waiter.communicate(timeout=240)[0]
        assert waiter.returncode == 0, out
        assert_books_balance(conn, batch, 10)
        lines = (tmp_path / "out.jsonl").read_text().splitlines()
        assert [json.loads(x)["custom_id"] for x in lines] == [f"r{i}" for i in range(10)]
    finally:
        log = stop(w)
        server.stop()
    assert w.returncode == 0, log
    assert "Redis unreachable" in log and "Redis reachable again" in log, log


def test_cancel_stops_queued_and_running_jobs(tiny_model, valkey_url, conn):
    batch = submit(conn, 10, max_tokens=1800)
    a = start_worker(valkey_url, tiny_model, name="cancelled")
    try:
        wait_until(lambda: batches.batch_status(conn, batch).started > 0, 120, "jobs to start")
        env = {**os.environ, "MLXQ_REDIS_URL": valkey_url}
        res = subprocess.run(
            [sys.executable, "-m", "mlxq", "cancel", batch],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        settled = lambda: (s := batches.batch_status(conn, batch)).queued + s.started == 0  # noqa: E731
        wait_until(settled, 60, "every job to be cancelled or done")
    finally:
        out = stop(a)
    assert a.returncode == 0, out
    s = batches.batch_status(conn, batch)
    assert s.cancelled >= 1 and s.cancelled + s.finished == 10, s
    results = list(batches.iter_batch_results(conn, batch))
    cancelled = [r for r in results if r.finish_reason == "cancelled"]
    assert len(cancelled) == s.cancelled
    assert any(r.token_ids for r in cancelled)  # the running ones kept their partial output


def test_a_worker_that_sleeps_past_its_heartbeat_never_writes_twice(tiny_model, valkey_url, conn):
    """A laptop lid closed mid-batch: SIGSTOP the worker, let another take its jobs, then
    SIGCONT it. Its late results must be dropped: every job keeps exactly one result."""
    batch = submit(conn, 6, max_tokens=1500)
    a = start_worker(valkey_url, tiny_model, "--abandon-after", "3", name="sleeper")
    wait_until(lambda: batches.batch_status(conn, batch).started > 0, 120, "jobs to start")
    a.send_signal(signal.SIGSTOP)
    b = start_worker(valkey_url, tiny_model, "--abandon-after", "3", name="awake")
    try:
        wait_until(lambda: batches.batch_status(conn, batch).done == 6, 180, "the batch to finish")
        a.send_signal(signal.SIGCONT)
        time.sleep(5)  # the sleeper wakes, finishes its copies, and must drop them
    finally:
        a.send_signal(signal.SIGCONT)
        out_a, out_b = stop(a), stop(b)
    assert a.returncode == 0 and b.returncode == 0, out_a + out_b
    results = assert_books_balance(conn, batch, 6)
    assert "awake" in {r.worker for r in results}
    assert "were taken back while it was away" in out_a, out_a
