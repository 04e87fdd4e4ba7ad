"""Nothing lost in the shape users run: long-lived workers (never ``--burst``) on their
default queues (the model's and ``default``) or on several ``-q`` queues, started before the
jobs arrive and idle between batches, fed by ``mlxq submit --wait``, the Python client and
the official OpenAI client through ``mlxq api``. Every test checks that each job finished
exactly once."""

from __future__ import annotations

import csv
import json
import time

import pytest
import redis

from mlxq.broker import batches
from mlxq.broker.rq_store import rq_keys
from mlxq.wire import Request
from tests.helpers import run_mlxq, wait_blocked

pytestmark = pytest.mark.slow


def assert_each_once(conn: redis.Redis, batch_id: str, n: int) -> None:
    """Every job of the batch finished, each with exactly one result, in input order."""
    status = batches.batch_status(conn, batch_id)
    assert (status.total, status.finished, status.queued, status.started) == (n, n, 0, 0), status
    ids = batches.batch_job_ids(conn, batch_id)
    assert [conn.xlen(rq_keys.results_key(j)) for j in ids] == [1] * n
    results = list(batches.iter_batch_results(conn, batch_id))
    assert [r.custom_id for r in results] == [f"c{i}" for i in range(n)]


def submit(conn: redis.Redis, n: int, queue: str) -> str:
    reqs = [Request(prompt=f"Line {i}:", max_tokens=3 + i % 4, custom_id=f"c{i}") for i in range(n)]
    return batches.submit(conn, reqs, queue=queue).batch_id


def test_cli_submit_wait_on_a_long_lived_worker_idle_between_three_batches(
    start, conn, valkey_url, tiny_model, tmp_path
):
    """The README's setup: `mlxq worker --model M` (its queues: M's and default), then
    `mlxq submit FILE --model M --wait`, three times, the worker idle in between."""
    start()
    lines = [
        {"prompt": f"Say {i}", "max_tokens": 2 + i % 5, "custom_id": f"c{i}"} for i in range(7)
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for round_ in range(3):
        out = tmp_path / f"r{round_}.jsonl"
        args = ("submit", str(prompts), "--model", tiny_model, "--wait", "--timeout", "120")
        done = run_mlxq(*args, "-o", str(out), url=valkey_url)
        assert done.returncode == 0, done.stderr
        results = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(7)]
        assert all(r["finish_reason"] in ("stop", "length") for r in results)
        assert_each_once(conn, results[0]["batch_id"], 7)
        wait_blocked(conn)
    # -o names the format, as for `mlxq run` and `mlxq results`: a CSV table here
    table = tmp_path / "r.csv"
    args = ("submit", str(prompts), "--model", tiny_model, "--wait", "--timeout", "120")
    done = run_mlxq(*args, "-o", str(table), url=valkey_url)
    assert done.returncode == 0, done.stderr
    with table.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["custom_id"] for r in rows] == [f"c{i}" for i in range(7)]


# One queue and several: RQ's blocking dequeue takes a different path for each.
@pytest.mark.parametrize("queues", [["one"], ["a", "b", "c"]])
def test_twenty_wake_ups_lose_nothing(start, conn, queues):
    """20 batches, each to a worker idle in its blocking pull, on each of its queues in
    turn (a later queue wakes it by its poll, the first by its blocking move)."""
    start(*[arg for name in queues for arg in ("-q", name)])
    for wake in range(20):
        batch = submit(conn, 3, queues[wake % len(queues)])
        batches.wait_for_batch(conn, batch, timeout=120)
        assert_each_once(conn, batch, 3)
        wait_blocked(conn)


def test_queue_order_is_honoured(start, conn):
    """`-q high -q low`: with both waiting, the high queue's jobs are taken first."""
    low = submit(conn, 4, "low")
    high = submit(conn, 4, "high")
    start("-q", "high", "-q", "low", "--max-batch", "1")
    for batch in (high, low):
        batches.wait_for_batch(conn, batch, timeout=120)
        assert_each_once(conn, batch, 4)
    results = [r for b in (high, low) for r in batches.iter_batch_results(conn, b)]
    starts = [r.timing.started_at for r in results]
    assert max(starts[:4]) <= min(starts[4:])


def test_openai_client_against_mlxq_api_with_a_long_lived_worker(start, conn, valkey_url):
    """The OpenAI Batch flow, the worker on its default queues, two batches apart."""
    from api_servers import KEY, api_client, chat_line, jsonl, serve

    server, thread, port = serve(valkey_url, sweep_interval=0.2)
    try:
        start()
        client = api_client(port, KEY)
        for round_ in range(2):
            lines = [chat_line(f"c{i}", f"Hello {round_} {i}") for i in range(5)]
            f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            batch = client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            deadline = time.monotonic() + 120
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                assert time.monotonic() < deadline, batch
                time.sleep(0.2)
                batch = client.batches.retrieve(batch.id)
            assert batch.status == "completed", batch
            assert batch.request_counts.completed == 5 and batch.request_counts.failed == 0
            out = client.files.content(batch.output_file_id).text.splitlines()
            assert sorted(json.loads(line)["custom_id"] for line in out) == [
                f"c{i}" for i in range(5)
            ]
            wait_blocked(conn)
    finally:
        server.should_exit = True
        thread.join(10)
