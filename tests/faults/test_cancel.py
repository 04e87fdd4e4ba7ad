"""Cancelling a running batch in the shape users do it: a long-lived worker on its default
queues (never ``--burst``) running a 300-job batch beside another batch on the same queue,
cancelled mid-run with ``mlxq cancel`` (a process of its own) or through the OpenAI client
against ``mlxq api``. Once the cancel has answered no job of the batch starts, its running
jobs stop, nothing of it is left in any queue, and the batch beside it finishes, each job
once."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
import redis

from mlxq.api import redis_keys as rk
from mlxq.broker import batches, keys
from mlxq.broker.rq_store import lanes, rq_keys
from mlxq.wire import Request
from tests.helpers import run_mlxq

pytestmark = pytest.mark.slow
MAX_BATCH = 8  # the `start` fixture's workers' --max-batch
BIG, BESIDE = 300, 150


def _started_at(conn: redis.Redis, job_ids: list[str]) -> list[float | None]:
    """Each job's RQ ``started_at`` (written by the start script), as Unix seconds."""
    with conn.pipeline(transaction=False) as pipe:
        for j in job_ids:
            pipe.hget(rq_keys.job_key(j), "started_at")
        raw = pipe.execute()
    return [_unix(r.decode()) if r else None for r in raw]


def _unix(text: str) -> float:
    """RQ's UTC timestamp text as Unix seconds."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def _wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _settled(conn: redis.Redis, batch_id: str) -> bool:
    s = batches.batch_status(conn, batch_id)
    return s.queued == 0 and s.started == 0


def assert_cancelled_cleanly(
    conn: redis.Redis, batch_id: str, queue: str, answered: float
) -> dict[str, int]:
    """What every cancel must leave: no job of the batch started after the cancel answered,
    each job with exactly one result (finished before it, or cancelled), nothing of it in
    any list or registry, no per-job cancel flag left. Returns its jobs by final status."""
    ids = batches.batch_job_ids(conn, batch_id)
    late = [t for t in _started_at(conn, ids) if t is not None and t > answered]
    assert late == [], f"{len(late)} jobs started after the cancel answered"
    results = list(batches.iter_batch_results(conn, batch_id))
    assert all(r is not None for r in results)
    assert [conn.xlen(rq_keys.results_key(j)) for j in ids] == [1] * len(ids)
    reasons = [r.finish_reason for r in results if r is not None]
    assert set(reasons) <= {"stop", "length", "cancelled"}, set(reasons)
    mine = {j.encode() for j in ids}
    for listed in (
        rq_keys.queue_key(queue),
        batches.make_queue(conn, queue).intermediate_queue_key,
    ):
        assert not mine & set(conn.lrange(listed, 0, -1)), listed
    assert not conn.exists(keys.lane(queue, batch_id), keys.batch_lanes(batch_id))
    for rotation in lanes.rotations([queue]):
        assert keys.lane(queue, batch_id).encode() not in conn.lrange(rotation, 0, -1)
    started = {m.split(b":")[0] for m in conn.zrange(rq_keys.started_key(queue), 0, -1)}
    assert not mine & started
    assert list(conn.scan_iter(keys.cancel_flag("*"))) == []
    assert 0 < conn.ttl(keys.batch_cancelled(batch_id)) <= keys.BATCH_TTL
    s = batches.batch_status(conn, batch_id)
    assert s.state == "cancelled" and s.finished + s.cancelled == s.total, s
    return {"finished": s.finished, "cancelled": s.cancelled}


def assert_each_once(conn: redis.Redis, batch_id: str, n: int) -> None:
    s = batches.batch_status(conn, batch_id)
    assert (s.total, s.finished, s.queued, s.started) == (n, n, 0, 0), s
    ids = batches.batch_job_ids(conn, batch_id)
    assert [conn.xlen(rq_keys.results_key(j)) for j in ids] == [1] * n


def _beside(conn: redis.Redis, queue: str) -> str:
    reqs = [Request(prompt=f"Other {i}:", max_tokens=4, custom_id=f"o{i}") for i in range(BESIDE)]
    return batches.submit(conn, reqs, queue=queue).batch_id


def test_mlxq_cancel_stops_a_running_batch_at_once(start, conn, valkey_url, tiny_model, tmp_path):
    start()
    queue = keys.queue_name_for_model(tiny_model)
    lines = [
        {"prompt": f"Line {i}:", "max_tokens": 12 + i % 8, "custom_id": f"c{i}"} for i in range(BIG)
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run_mlxq("submit", str(prompts), "--model", tiny_model, url=valkey_url)
    assert done.returncode == 0, done.stderr
    batch = re.search(r"batch (b[0-9a-f]+)", done.stdout).group(1)
    beside = _beside(conn, queue)
    _wait(lambda: batches.batch_status(conn, batch).finished >= 2 * MAX_BATCH, 120, "no progress")

    asked = time.time()
    done = run_mlxq("cancel", batch, "--json", url=valkey_url)
    answered = time.time()
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)
    # (its jobs running then: at most what one worker holds)
    assert counts["stopping"] <= 2 * MAX_BATCH, counts
    _wait(lambda: _settled(conn, batch), 30, "the cancelled batch's running jobs did not stop")
    batches.wait_for_batch(conn, beside, timeout=300)
    assert_each_once(conn, beside, BESIDE)
    ended = assert_cancelled_cleanly(conn, batch, queue, answered)
    assert ended["cancelled"] >= counts["removed"] > 0
    status = run_mlxq("status", batch, "--json", url=valkey_url)
    assert json.loads(status.stdout)["state"] == "cancelled"
    print(f"mlxq cancel: {answered - asked:.2f} s (process included), {counts}, {ended}")


def test_openai_cancel_answers_at_once_and_reads_never_wait(
    start, conn, valkey_url, tiny_model, monkeypatch
):
    import api_servers
    from api_servers import KEY, api_client, chat_line, jsonl, read_jsonl, serve

    monkeypatch.setattr(api_servers, "MAX_LINES", BIG)
    monkeypatch.setattr(api_servers, "MAX_UPLOAD", 1024 * 1024)
    # No sweep: the cancel's own thread carries it out, and reads only read.
    server, thread, port = serve(valkey_url, sweep_interval=0)
    try:
        start()
        queue = keys.queue_name_for_model(tiny_model)
        client = api_client(port, KEY)
        lines = [chat_line(f"c{i}", f"Hello {i}", max_tokens=12 + i % 8) for i in range(BIG)]
        f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        created = client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        mlxq_id = json.loads(conn.get(rk.batch_record(created.id)))["mlxq_batch_id"]
        beside = _beside(conn, queue)
        _wait(
            lambda: batches.batch_status(conn, mlxq_id).finished >= 2 * MAX_BATCH,
            120,
            "no progress",
        )

        def timed(call):
            t = time.monotonic()
            out = call()
            return out, time.monotonic() - t

        # Two cancels at once (a retrying client, another admin) and a read among them.
        with ThreadPoolExecutor(3) as pool:
            cancels = [pool.submit(timed, lambda: client.batches.cancel(created.id)) for _ in "ab"]
            read = pool.submit(timed, lambda: client.batches.retrieve(created.id))
            answers = [c.result() for c in cancels]
            read.result()
        answered = time.time()
        for batch, took in answers:
            assert batch.status in ("cancelling", "cancelled") and took < 1.0, (batch.status, took)
        reads = []
        batch = client.batches.retrieve(created.id)
        deadline = time.monotonic() + 60
        while batch.status != "cancelled":
            assert batch.status in ("cancelling", "finalizing"), batch.status
            assert time.monotonic() < deadline, "the batch did not end"
            batch, took = timed(lambda: client.batches.retrieve(created.id))
            reads.append(took)
        assert reads and max(reads) < 1.0, reads
        assert batch.cancelling_at and batch.cancelled_at

        ended = assert_cancelled_cleanly(conn, mlxq_id, queue, answered)
        out = read_jsonl(client, batch.output_file_id) if batch.output_file_id else {}
        errors = read_jsonl(client, batch.error_file_id)
        assert not set(out) & set(errors)
        assert set(out) | set(errors) == {f"c{i}" for i in range(BIG)}
        assert len(out) == ended["finished"] and len(errors) == ended["cancelled"]
        assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
        assert (batch.request_counts.completed, batch.request_counts.failed) == (
            len(out),
            len(errors),
        )
        batches.wait_for_batch(conn, beside, timeout=300)
        assert_each_once(conn, beside, BESIDE)
        print(
            f"API cancel: {max(t for _, t in answers):.3f} s; reads up to {max(reads):.3f} s; "
            f"{len(out)} finished, {len(errors)} cancelled; reads {[round(r, 3) for r in reads]}"
        )
    finally:
        server.should_exit = True
        thread.join(10)
