"""The worker against a Redis that limits it, set for real on the test server (and restored):
a result larger than Redis takes fails its own job with an error that says so, the others are
written; a full ``noeviction`` Redis holds results until it takes writes again; an evicting
policy set under a running worker stops its intake until the policy is fixed."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from rq.job import Job

from mlxq.broker import batches
from mlxq.broker.serializer import serializer
from mlxq.wire import Request, Result
from mlxq.worker import outage
from mlxq.worker.launch import Setup, _reporter, run_worker
from mlxq.worker.profile import WorkerProfile
from mlxq.worker.rq_worker import MlxqWorker
from tests.helpers import ROOT

BIG = Request(prompt="Tell a story", max_tokens=1900, logprobs=20, custom_id="big")  # ~1.4 MB
SMALL = [Request(prompt=f"Hello {i}", max_tokens=4, custom_id=f"small-{i}") for i in range(3)]
SETTINGS = ("maxmemory", "maxmemory-policy", "proto-max-bulk-len")


@pytest.fixture
def profile(tiny_model: str) -> WorkerProfile:
    return WorkerProfile(model=tiny_model, max_batch=4, prefill_batch=2)


@pytest.fixture
def server(conn: redis.Redis, valkey_url: str) -> Iterator[redis.Redis]:
    """A second client on the test server, its limits put back as they were afterwards."""
    before = {k: conn.config_get(k)[k] for k in SETTINGS}
    admin = redis.Redis.from_url(valkey_url)
    yield admin
    admin.config_set("maxmemory", 0)  # first: the others need memory to be set
    for key, value in before.items():
        admin.config_set(key, value)
    admin.close()


class OnLog(logging.Handler):
    """Calls ``act(n)`` on the n-th worker log record containing ``text`` (in the worker's
    own thread: what it does happens before the worker's next step)."""

    def __init__(self, text: str, act: Callable[[int], None]) -> None:
        super().__init__()
        self.text, self.act, self.seen = text, act, 0
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if self.text in message:
            self.seen += 1
            self.act(self.seen)


@pytest.fixture
def on_log() -> Iterator[Callable[[str, Callable[[int], None]], OnLog]]:
    handlers: list[OnLog] = []

    def add(text: str, act: Callable[[int], None]) -> OnLog:
        handlers.append(OnLog(text, act))
        logging.getLogger("rq.worker").addHandler(handlers[-1])  # the worker's own log
        return handlers[-1]

    yield add
    for h in handlers:
        logging.getLogger("rq.worker").removeHandler(h)


def _by_id(conn: redis.Redis, batch_id: str) -> dict[str, Result]:
    return {r.custom_id or "": r for r in batches.iter_batch_results(conn, batch_id)}


def _assert_big_failed_alone(conn: redis.Redis, batch_id: str, reason: str) -> None:
    """The big result's job failed once with an error naming the limit and the fix; the
    small ones finished; the error result kept the usage."""
    by_id = _by_id(conn, batch_id)
    big = by_id["big"]
    assert big.finish_reason == "error" and big.token_ids == [] and big.logprobs is None
    assert "too large for Redis" in big.error and reason in big.error, big.error
    assert "lower max_tokens or logprobs" in big.error
    assert big.usage.prompt_tokens > 0 and big.usage.completion_tokens == 1900
    assert all(by_id[f"small-{i}"].finish_reason in ("stop", "length") for i in range(3))
    s = batches.batch_status(conn, batch_id)
    assert (s.finished, s.failed, s.queued, s.started) == (3, 1, 0, 0), s
    job = Job.fetch(big.job_id, connection=conn, serializer=serializer)
    assert job.get_status() == "failed"  # not retried: a rerun makes the same result


def test_a_result_over_proto_max_bulk_len_fails_alone(conn, server, profile):
    server.config_set("proto-max-bulk-len", "1mb")  # Redis's smallest
    info = batches.submit(conn, [BIG, *SMALL], queue="limits", retries=2)
    run_worker(profile, conn, burst=True, queues=["limits"])
    _assert_big_failed_alone(conn, info.batch_id, "proto-max-bulk-len of 1,048,576 bytes")


def test_a_limit_lowered_under_the_worker_fails_only_the_result_redis_chokes_on(
    conn, server, profile
):
    """Lowered after the worker read it: Redis drops the connection on the big write; the
    worker finds the one result it chokes on instead of retrying the batch forever."""
    info = batches.submit(conn, [BIG, *SMALL], queue="limits")

    def lower(result: Result) -> None:
        server.config_set("proto-max-bulk-len", "1mb")

    run_worker(profile, conn, burst=True, queues=["limits"], on_finish=lower)
    _assert_big_failed_alone(conn, info.batch_id, "over its proto-max-bulk-len")


def _worker(profile: WorkerProfile, conn: redis.Redis, **kwargs) -> MlxqWorker:
    """An in-process worker built as ``run_worker`` builds it, with ``kwargs`` for it."""
    setup = Setup(profile)
    config = setup.start()
    worker = MlxqWorker(
        ["limits"], connection=conn, runner=setup.runner, model_name=config.model, **kwargs
    )
    worker.reporter = _reporter(worker, config, None)
    return worker


def test_the_workers_own_result_cap(conn, profile):
    info = batches.submit(conn, [BIG, *SMALL], queue="limits")
    worker = _worker(profile, conn, max_result_bytes=100_000)
    worker.work(burst=True)
    _assert_big_failed_alone(conn, info.batch_id, "the worker's max result size")


def test_a_full_redis_holds_results_until_it_takes_writes_again(conn, server, profile, on_log):
    """Redis fills up (noeviction) while jobs run: the worker backs off with a line that
    says Redis is full and what to do, holds its results, and writes them all once it can."""
    info = batches.submit(conn, [BIG, *SMALL], queue="limits")
    full = on_log("Redis is full", lambda n: n == 2 and server.config_set("maxmemory", 0))

    def fill(result: Result) -> None:
        if not full.seen:
            server.config_set("maxmemory", 1)

    run_worker(profile, conn, burst=True, queues=["limits"], on_finish=fill)
    assert full.seen == 2
    line = next(m for m in full.messages if "Redis is full" in m)
    assert "CONFIG SET maxmemory" in line and "results held" in line, line
    assert any("Redis accepting writes again" in m for m in full.messages)
    by_id = _by_id(conn, info.batch_id)
    assert sorted(by_id) == ["big", "small-0", "small-1", "small-2"]
    assert all(r.finish_reason in ("stop", "length") for r in by_id.values())
    s = batches.batch_status(conn, info.batch_id)
    assert (s.finished, s.failed, s.queued, s.started) == (4, 0, 0, 0), s


def test_an_evicting_policy_set_under_the_worker_pauses_its_intake(
    conn, server, profile, on_log, monkeypatch
):
    monkeypatch.setattr(outage, "CHECK_INTERVAL_S", 0.05)
    info = batches.submit(conn, SMALL, queue="limits")
    worker = _worker(profile, conn)
    server.config_set("maxmemory-policy", "allkeys-lru")
    seen: list[tuple[bool, int]] = []

    def check(n: int) -> None:
        seen.append((worker.intake_paused, batches.batch_status(conn, info.batch_id).queued))
        if n == 3:  # three checks, passes between them: nothing taken meanwhile
            server.config_set("maxmemory-policy", "noeviction")

    paused = on_log("taking no new jobs", check)
    worker.work(max_jobs=3)
    assert seen == [(True, 3)] * 3
    line = next(m for m in paused.messages if "taking no new jobs" in m)
    assert "maxmemory-policy is allkeys-lru" in line and "CONFIG SET maxmemory-policy" in line
    assert any("maxmemory-policy is noeviction again" in m for m in paused.messages)
    s = batches.batch_status(conn, info.batch_id)
    assert (s.finished, s.queued) == (3, 0), s


def _start_worker(url: str, model: str, queue: str) -> tuple[subprocess.Popen, list[str]]:
    """``mlxq worker`` as a user starts it (long-lived), its output lines collected."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxq", "worker", "--model", model, "-q", queue, "--max-batch", "4"],
        cwd=ROOT,
        env={**os.environ, "MLXQ_REDIS_URL": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    return proc, lines


def _wait(pred: Callable[[], bool], proc: subprocess.Popen, lines: list[str], what: str) -> None:
    deadline = time.monotonic() + 180
    while not pred():
        assert proc.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, f"no {what}:\n" + "".join(lines)
        time.sleep(0.1)


def test_a_worker_started_on_a_full_redis_waits_for_it(conn, server, tiny_model, valkey_url):
    """A long-lived worker meets a Redis that is already full: it says so and waits (no
    traceback, no exit), then serves every job exactly once when there is room again."""
    info = batches.submit(conn, SMALL, queue="full")
    server.config_set("maxmemory", 1)
    proc, lines = _start_worker(valkey_url, tiny_model, "full")
    try:
        _wait(lambda: any("Redis is full" in x for x in lines), proc, lines, "'Redis is full'")
        assert batches.batch_status(conn, info.batch_id).queued == 3
        server.config_set("maxmemory", 0)
        _wait(
            lambda: batches.batch_status(conn, info.batch_id).finished == 3, proc, lines, "results"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    out = "".join(lines)
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert "CONFIG SET maxmemory" in out and "Redis accepting writes again" in out, out
    s = batches.batch_status(conn, info.batch_id)
    assert (s.finished, s.failed, s.queued, s.started) == (3, 0, 0, 0), s
    assert [r.custom_id for r in batches.iter_batch_results(conn, info.batch_id)] == [
        f"small-{i}" for i in range(3)
    ]
