"""Macs that sleep and wake, as users run them: a long-lived worker on its default queues
is frozen (SIGSTOP: a closed lid) past ``--abandon-after`` and ``--stall-timeout`` while it
holds jobs; a second worker takes them back and finishes the batch; then the first wakes
(SIGCONT), alone or with a SIGTERM waiting (how systemd and launchd stop a unit), or in the
middle of a model switch. Every job must have exactly one result in its results stream:
nothing the other worker finished is put back or run again."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from mlxq.broker import batches
from mlxq.broker.rq_store import rq_keys
from mlxq.wire import Request
from tests.helpers import Worker

pytestmark = pytest.mark.slow
TIMEOUTS = ("--abandon-after", "3", "--stall-timeout", "4")
FROZEN_S = 8  # past both timeouts above
WOKE = re.compile(r"did not run for \d+s|completed no step")  # the new and the old reaction


def _submit(conn: redis.Redis, n: int, queue: str = "default", tag: str = "c") -> str:
    reqs = [
        Request(prompt=f"Story {i}:", max_tokens=200 + 150 * (i % 8), custom_id=f"{tag}{i}")
        for i in range(n)
    ]
    return batches.submit(conn, reqs, queue=queue).batch_id


def _until(pred: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _each_once(conn: redis.Redis, batch_id: str, n: int) -> None:
    """The batch done, every job with exactly one entry in ``rq:results:<id>``."""
    batches.wait_for_batch(conn, batch_id, timeout=300)
    status = batches.batch_status(conn, batch_id)
    assert (status.total, status.finished, status.queued, status.started) == (n, n, 0, 0), status
    ids = batches.batch_job_ids(conn, batch_id)
    twice = [j for j in ids if conn.xlen(rq_keys.results_key(j)) != 1]
    assert not twice, f"{len(twice)} of {n} jobs have not exactly one result"


def _freeze_while_holding(conn: redis.Redis, a: Worker, batch_id: str) -> float:
    """SIGSTOP ``a`` once it runs jobs of the batch; when it was frozen."""
    started = lambda: batches.batch_status(conn, batch_id).started > 0  # noqa: E731
    _until(lambda: started() or a.proc.poll() is not None, 120, "jobs to start")
    assert a.proc.poll() is None, a.log.read_text()
    a.proc.send_signal(signal.SIGSTOP)
    return time.monotonic()


def _wake(a: Worker, frozen_at: float, *signals: signal.Signals) -> None:
    """Keep ``a`` frozen at least ``FROZEN_S``, send ``signals`` while it is, then SIGCONT."""
    time.sleep(max(0.0, frozen_at + FROZEN_S - time.monotonic()))
    for sig in signals:
        a.proc.send_signal(sig)
    a.proc.send_signal(signal.SIGCONT)


def _settled(a: Worker) -> None:
    """Until ``a`` has reacted to waking (or exited): what it puts back, it has put back."""
    _until(lambda: WOKE.search(a.log.read_text()) or a.proc.poll() is not None, 60, "a wake-up")
    time.sleep(1.0)  # its give-back, if any, lands in the same pass


def test_a_frozen_worker_woken_after_another_finished_its_jobs_runs_none_twice(start, conn):
    a = start(*TIMEOUTS, "--name", "sleeper")
    batch = _submit(conn, 40)
    frozen_at = _freeze_while_holding(conn, a, batch)
    b = start(*TIMEOUTS, "--name", "awake")
    batches.wait_for_batch(conn, batch, timeout=300)
    _wake(a, frozen_at)
    _settled(a)
    _each_once(conn, batch, 40)
    log = a.log.read_text()
    assert a.proc.poll() is None, log  # it serves on
    assert len(re.findall("were taken back while it was away", log)) <= 2, log  # not per job
    assert "were taken back while it was away" in log, log
    # and it still serves: a second batch, after both are idle, finishes once each
    second = _submit(conn, 16, tag="d")
    _each_once(conn, second, 16)
    assert b.proc.poll() is None


def test_a_frozen_worker_woken_with_a_sigterm_waiting_puts_back_nothing_done(start, conn):
    a = start(*TIMEOUTS, "--name", "sleeper")
    batch = _submit(conn, 40)
    frozen_at = _freeze_while_holding(conn, a, batch)
    start(*TIMEOUTS, "--name", "awake")
    batches.wait_for_batch(conn, batch, timeout=300)
    _wake(a, frozen_at, signal.SIGTERM)
    assert a.proc.wait(120) == 0, a.log.read_text()
    time.sleep(1.0)
    _each_once(conn, batch, 40)
    assert "put job" not in a.log.read_text()  # every job it held was done elsewhere


def test_a_frozen_worker_of_two_models_woken_mid_switch_runs_none_twice(
    two_models: tuple[str, str], valkey_url: str, conn: redis.Redis, tmp_path: Path
):
    alpha, beta = two_models
    args = ("--model", beta, *TIMEOUTS, "--min-model-seconds", "0")
    a = Worker(valkey_url, alpha, *args, "--name", "sleeper", log=tmp_path / "a.log")
    b = None
    try:
        a.wait_listening(conn)
        first = _submit(conn, 24, queue="alpha", tag="a")
        _until(lambda: batches.batch_status(conn, first).started > 0, 120, "alpha's jobs to start")
        second = _submit(conn, 24, queue="beta", tag="b")  # a switch is decided, then frozen
        time.sleep(0.6)
        a.proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        b = Worker(valkey_url, alpha, *args, "--name", "awake", log=tmp_path / "b.log")
        batches.wait_for_batch(conn, first, timeout=300)
        batches.wait_for_batch(conn, second, timeout=300)
        _wake(a, frozen_at)
        _settled(a)
        _each_once(conn, first, 24)
        _each_once(conn, second, 24)
        assert a.proc.poll() is None, a.log.read_text()
    finally:
        a.proc.send_signal(signal.SIGCONT)
        a.stop()
        if b is not None:
            b.stop()
