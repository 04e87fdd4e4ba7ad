"""Faults of big batches, for real: a submit process killed mid-way (then resumed or
cancelled), an MLX thread that hangs inside the engine, a Redis that would evict keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxq.broker import batches, fleet, keys
from mlxq.broker.rq_store import reads
from mlxq.server import make_server
from tests.faults.test_faults import ROOT, assert_books_balance, start_worker, submit
from tests.helpers import run_mlxq, start_submit, wait_until, waiting

pytestmark = pytest.mark.slow
N = 60_000  # big enough that a submit is killed long before it ends (~10k jobs/s)


def _prompts(tmp_path: Path, n: int = N) -> Path:
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"p{i}", "max_tokens": 4, "custom_id": f"c{i}"}) + "\n")
    return path


def _kill_submit_midway(url: str, conn, path: Path) -> str:
    """Start `mlxq submit`, read the batch id it prints first, SIGKILL it once some jobs
    are in; returns the batch id."""
    proc, batch_id = start_submit(url, path, "big")
    wait_until(lambda: conn.llen(keys.batch_jobs(batch_id)) > 0, 60, "the first chunk")
    proc.kill()
    proc.wait()
    return batch_id


def test_a_killed_submit_leaves_a_batch_that_resume_completes(valkey_url, conn, tmp_path):
    path = _prompts(tmp_path)
    batch_id = _kill_submit_midway(valkey_url, conn, path)
    s = batches.batch_status(conn, batch_id)
    assert s.state == "submitting" and 0 < s.enqueued < N and s.total == N, s
    assert s.queued == s.enqueued == waiting(conn, "big")
    # Until its lease lapses the dead submit may still be alive: resume waits for it.
    out = run_mlxq("status", batch_id, url=valkey_url)
    assert "still being submitted" in out.stdout, out.stdout
    refused = run_mlxq("submit", str(path), "--resume", batch_id, url=valkey_url)
    assert refused.returncode == 1 and "still being submitted" in refused.stderr
    conn.delete(keys.batch_submitter(batch_id))  # the lease lapsing (30 s)
    out = run_mlxq("status", batch_id, url=valkey_url)
    assert f"only {s.enqueued} of {N} requests were enqueued" in out.stdout
    assert f"--resume {batch_id}" in out.stdout
    done = run_mlxq("submit", str(path), "--resume", batch_id, url=valkey_url)
    assert done.returncode == 0, done.stderr
    assert f"{s.enqueued} requests were enqueued before, {N - s.enqueued} now" in done.stderr
    s = batches.batch_status(conn, batch_id)
    assert (s.state, s.enqueued, s.queued) == ("submitted", N, N)
    ids = batches.batch_job_ids(conn, batch_id)
    assert len(set(ids)) == N == waiting(conn, "big")
    metas = reads.job_metas(conn, ids)
    assert [m.index for m in metas] == list(range(N))  # every line once, in order
    assert [m.custom_id for m in metas[-2:]] == [f"c{N - 2}", f"c{N - 1}"]


def test_cancel_removes_the_jobs_of_a_killed_submit(valkey_url, conn, tmp_path):
    path = _prompts(tmp_path)
    batch_id = _kill_submit_midway(valkey_url, conn, path)
    enqueued = batches.batch_status(conn, batch_id).enqueued
    out = run_mlxq("cancel", batch_id, url=valkey_url)
    assert out.returncode == 0 and f"removed {enqueued} queued jobs" in out.stdout, out
    s = batches.batch_status(conn, batch_id)
    assert (s.state, s.queued, s.cancelled) == ("cancelled", 0, enqueued)
    assert waiting(conn, "big") == 0
    conn.delete(keys.batch_submitter(batch_id))
    again = run_mlxq("submit", str(path), "--resume", batch_id, url=valkey_url)
    assert again.returncode == 1 and "was cancelled" in again.stderr


HANGING_WORKER = """
import sys, threading
import mlxq.worker.launch as launch

real = launch.engine_for

def engine_for(*args, **kwargs):
    engine = real(*args, **kwargs)
    step, calls = engine.step, [0]

    def hanging_step():
        calls[0] += 1
        if calls[0] > 3:
            threading.Event().wait()  # never returns, like a hung native call
        return step()

    engine.step = hanging_step
    return engine

launch.engine_for = engine_for
from mlxq.cli.main import main

sys.argv = ["mlxq", *sys.argv[1:]]
main()
"""


def test_a_stalled_engine_puts_its_jobs_back_and_exits_nonzero(tiny_model, valkey_url, conn):
    batch = submit(conn, 4, max_tokens=400)
    cmd = [sys.executable, "-c", HANGING_WORKER, "worker", "--model", tiny_model]
    cmd += ["-q", "faults", "--max-batch", "4", "--stall-timeout", "3", "--name", "hung"]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "MLXQ_REDIS_URL": valkey_url},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 3, proc.stderr
    assert "engine stalled" in proc.stderr and "--stall-timeout 3" in proc.stderr
    s = batches.batch_status(conn, batch)
    assert s.started == 0 and s.queued == 4, s
    (info,) = fleet.live_workers(conn)
    assert info.name == "hung" and info.state == "stalled" and info.step_age_s >= 3
    shown = run_mlxq("workers", url=valkey_url)
    assert "hung [stalled]" in shown.stdout, shown.stdout
    rescuer = start_worker(valkey_url, tiny_model, "--burst", name="after")
    out = rescuer.communicate(timeout=300)[0]
    assert rescuer.returncode == 0, out
    assert_books_balance(conn, batch, 4)


@pytest.fixture
def evicting_url():
    server = make_server()
    server.start()
    try:
        url = server.connection_url + "/0"
        batches.connect(url).config_set("maxmemory-policy", "allkeys-lru")
        yield url
    finally:
        server.stop()


@pytest.mark.parametrize(
    "args",
    [
        ("submit", "examples/prompts.jsonl"),
        ("worker", "--model", "no-such-model-needed"),
        ("api", "--no-auth"),
    ],
)
def test_an_evicting_redis_is_refused_in_one_line(evicting_url, args):
    out = run_mlxq(*args, url=evicting_url, timeout=60)
    assert out.returncode == 1, out
    (line,) = out.stderr.strip().splitlines()
    assert "maxmemory-policy is allkeys-lru" in line and "CONFIG SET maxmemory-policy" in line
    assert "noeviction" in line and "managed service" in line
    assert batches.connect(evicting_url).dbsize() == 0  # nothing was written
    assert run_mlxq("status", url=evicting_url).returncode == 0  # reading is still allowed
