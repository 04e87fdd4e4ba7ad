"""Priorities and fairness as users run them: a long-lived worker (never ``--burst``) on its
default queues (the model's and ``default``), started before the jobs; two batches submitted
with ``mlxq submit --priority``, a big one first and a small one after, on the same queue or
one on each (``--model`` sends a batch to the model's queue, none to ``default``). Order is
read from the results' ``finished_at`` (what ran first), never from how fast the machine is:
the worker is paused (SIGSTOP) while both are submitted, so both wait when it looks. Every
job finishes exactly once."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import redis

from mlxq.broker import batches
from mlxq.broker.keys import queue_name_for_model
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


def _submit(url: str, path: Path, model: str | None, priority: str) -> str:
    """The batch id of ``mlxq submit PATH`` (``--model MODEL`` unless None: ``default``)."""
    chosen = ("--model", model) if model is not None else ()
    done = run_mlxq("submit", str(path), *chosen, "--priority", priority, url=url)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split()[-1]


def _finished(conn: redis.Redis, batch_id: str) -> list[float]:
    times = [r.timing.finished_at for r in batches.iter_batch_results(conn, batch_id) if r]
    assert all(t is not None for t in times)
    return sorted(t for t in times if t is not None)


def _big_then_small(
    start,
    conn: redis.Redis,
    url: str,
    models: tuple[str | None, str | None],
    tmp_path: Path,
    priorities: tuple[str, str],
    sizes: tuple[int, int] = (BIG, SMALL),
) -> tuple[list[float], list[float]]:
    """Both batches submitted while the worker is paused (each with its model, None for
    ``default``); the finish times of each."""
    worker = start("--max-batch", str(MAX_BATCH))
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        big = _submit(url, _file(tmp_path, "big", sizes[0]), models[0], priorities[0])
        small = _submit(url, _file(tmp_path, "small", sizes[1]), models[1], priorities[1])
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    for batch_id, n in ((small, sizes[1]), (big, sizes[0])):
        batches.wait_for_batch(conn, batch_id, timeout=300)
        assert_each_once(conn, batch_id, n)
    assert batches.get_batch(conn, big).priority == priorities[0]
    for batch_id, model in ((big, models[0]), (small, models[1])):
        assert batches.get_batch(conn, batch_id).queue == queue_name_for_model(model)
    status = run_mlxq("status", small, url=url)
    assert f"priority {priorities[1]}" in status.stdout, status.stdout
    return _finished(conn, big), _finished(conn, small)


def test_a_small_high_batch_after_a_big_low_one_runs_first(
    start, conn, valkey_url, tiny_model, tmp_path
):
    big, small = _big_then_small(
        start, conn, valkey_url, (tiny_model,) * 2, tmp_path, ("low", "high")
    )
    ahead = sum(t < small[-1] for t in big)
    assert ahead <= AHEAD, f"{ahead} of the big low batch's jobs finished before the high one"
    assert small[-1] < big[-1]


def test_a_small_batch_after_a_big_one_of_equal_priority_is_not_kept_waiting(
    start, conn, valkey_url, tiny_model, tmp_path
):
    """Equal priorities share the worker a job at a time: the small batch is done long
    before the big one, not after all of it."""
    big, small = _big_then_small(
        start, conn, valkey_url, (tiny_model,) * 2, tmp_path, ("normal", "normal")
    )
    ahead = sum(t < small[-1] for t in big)
    assert ahead <= SMALL + AHEAD, f"{ahead} of the big batch's jobs finished before the small one"
    assert small[-1] < big[-1]


# One batch on each of the worker's queues: 300 and 10, as the README's promise is measured.
CROSS_BIG, CROSS_SMALL = 300, 10


@pytest.mark.parametrize("big_on_model", [True, False], ids=["big-on-model", "big-on-default"])
def test_equal_batches_on_the_workers_two_queues_share_it(
    start, conn, valkey_url, tiny_model, tmp_path, big_on_model
):
    """300 jobs on the model's queue, then 10 on ``default`` (and the other way round):
    the 10 are done while most of the 300 still wait, whichever queue the worker lists
    first; nothing is lost, each job has one result."""
    models = (tiny_model, None) if big_on_model else (None, tiny_model)
    big, small = _big_then_small(
        start, conn, valkey_url, models, tmp_path, ("normal",) * 2, (CROSS_BIG, CROSS_SMALL)
    )
    ahead = sum(t < small[-1] for t in big)
    assert ahead <= CROSS_SMALL + AHEAD, f"{ahead} of the 300 finished before the 10"
    assert small[-1] < big[-1]


def test_a_high_batch_on_default_goes_before_a_normal_one_on_the_models_queue(
    start, conn, valkey_url, tiny_model, tmp_path
):
    """Priorities are strict over the worker's queues: a small high batch on ``default``
    submitted after a big normal one on the model's queue runs first."""
    big, small = _big_then_small(
        start, conn, valkey_url, (tiny_model, None), tmp_path, ("normal", "high")
    )
    ahead = sum(t < small[-1] for t in big)
    assert ahead <= AHEAD, f"{ahead} of the big normal batch's jobs finished before the high one"
    assert small[-1] < big[-1]
