"""Priorities and fairness as users run them: a long-lived worker (never ``--burst``) on its
default queues (the model's and ``default``), started before the jobs; two batches submitted
with ``mlxq submit --priority``, a big one first and a small one after. Order is read from
the results' ``finished_at`` (what ran first), never from how fast the machine is: the
worker is paused (SIGSTOP) while both are submitted, so both wait when it looks. Every job
finishes exactly once."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import redis

from mlxq.broker import batches as q
from tests.faults.test_user_shape import assert_each_once
from tests.helpers import run_mlxq

pytestmark = pytest.mark.slow
BIG, SMALL, MAX_BATCH = 200, 5, 4
# The worker holds at most its batch plus a small prefetch before it pulls again: at most
# this many of the big batch's jobs can be ahead of the small one's without unfairness.
AHEAD = 2 * MAX_BATCH + SMALL


def _file(tmp_path: Path, name: str, n: int) -> Path:
    path = tmp_path / f"{name}.jsonl"
    lines = [
        {"prompt": f"{name} {i}:", "max_tokens": 3 + i % 4, "custom_id": f"c{i}"} for i in range(n)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _submit(url: str, path: Path, model: str, priority: str) -> str:
    done = run_mlxq("submit", str(path), "--model", model, "--priority", priority, url=url)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split()[-1]


def _finished(conn: redis.Redis, batch_id: str) -> list[float]:
    times = [r.timing.finished_at for r in q.iter_batch_results(conn, batch_id) if r]
    assert all(t is not None for t in times)
    return sorted(t for t in times if t is not None)


def _big_then_small(
    start, conn: redis.Redis, url: str, model: str, tmp_path: Path, priorities: tuple[str, str]
) -> tuple[list[float], list[float]]:
    """Both batches submitted while the worker is paused; the finish times of each."""
    worker = start("--max-batch", str(MAX_BATCH))
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        big = _submit(url, _file(tmp_path, "big", BIG), model, priorities[0])
        small = _submit(url, _file(tmp_path, "small", SMALL), model, priorities[1])
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    for batch_id, n in ((small, SMALL), (big, BIG)):
        q.wait_for_batch(conn, batch_id, timeout=300)
        assert_each_once(conn, batch_id, n)
    assert q.get_batch(conn, big).priority == priorities[0]
    status = run_mlxq("status", small, url=url)
    assert f"priority {priorities[1]}" in status.stdout, status.stdout
    return _finished(conn, big), _finished(conn, small)


def test_a_small_high_batch_after_a_big_low_one_runs_first(
    start, conn, valkey_url, tiny_model, tmp_path
):
    big, small = _big_then_small(start, conn, valkey_url, tiny_model, tmp_path, ("low", "high"))
    ahead = sum(t < small[-1] for t in big)
    assert ahead <= AHEAD, f"{ahead} of the big low batch's jobs finished before the high one"
    assert small[-1] < big[-1]


def test_a_small_batch_after_a_big_one_of_equal_priority_is_not_kept_waiting(
    start, conn, valkey_url, tiny_model, tmp_path
):
    """Equal priorities share the worker a job at a time: the small batch is done long
    before the big one, not after all of it."""
    big, small = _big_then_small(
        start, conn, valkey_url, tiny_model, tmp_path, ("normal", "normal")
    )
    ahead = sum(t < small[-1] for t in big)
    assert ahead <= SMALL + AHEAD, f"{ahead} of the big batch's jobs finished before the small one"
    assert small[-1] < big[-1]
