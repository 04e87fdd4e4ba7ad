"""Streaming: a `stream: true` job's tokens reach a Redis stream while it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlxq.broker import batches
from mlxq.client import Client
from mlxq.wire import Request
from mlxq.worker.launch import run_worker
from mlxq.worker.profile import WorkerProfile

ROOT = Path(__file__).resolve().parents[2]


def test_stream_carries_the_whole_output_in_order(conn, valkey_url, tiny_model):
    reqs = [
        Request(prompt="Stream me a story", max_tokens=40, stream=True),
        Request(prompt="Not streamed", max_tokens=8),
    ]
    info = batches.submit(conn, reqs, queue="st")
    streamed_id, plain_id = batches.batch_job_ids(conn, info.batch_id)
    run_worker(WorkerProfile(model=tiny_model, max_batch=2), conn, burst=True, queues=["st"])
    result = Client(valkey_url).result(streamed_id)
    entries = list(Client(valkey_url).stream(streamed_id))
    assert len(entries) >= 3  # several chunks, then the end marker
    assert entries[-1].finish_reason == result.finish_reason
    assert [t for e in entries for t in e.token_ids] == result.token_ids
    assert "".join(e.text for e in entries) == result.text
    assert not conn.exists(f"mlxq:stream:{plain_id}")


def test_mlxq_tail_follows_a_running_job(conn, valkey_url, tiny_model):
    info = batches.submit(
        conn, [Request(prompt="Tell me more", max_tokens=300, stream=True)], queue="tail"
    )
    job_id = batches.batch_job_ids(conn, info.batch_id)[0]
    env = {**os.environ, "MLXQ_REDIS_URL": valkey_url}
    tail = subprocess.Popen(
        [sys.executable, "-m", "mlxq", "tail", job_id],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_worker(WorkerProfile(model=tiny_model, max_batch=2), conn, burst=True, queues=["tail"])
    out, err = tail.communicate(timeout=60)
    assert tail.returncode == 0, err
    result = Client(valkey_url).result(job_id)
    assert out.rstrip("\n") == result.text
    assert f"[{result.finish_reason}]" in err
