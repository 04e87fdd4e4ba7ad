"""A worker that serves several models (``mlxq worker --model A --model B``), as users run
it: one long-lived process started before the jobs, idle between them, switching models as
their queues fill. Every job has exactly one result, made by the model of its queue (its
text is that model's greedy answer), and each switch is logged and counted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from mlxq.broker import batches as broker_batches
from mlxq.broker import fleet
from mlxq.broker.rq_store import rq_keys
from mlxq.wire import Request, Result
from tests.helpers import ROOT, Worker, free_port, run_mlxq, wait_blocked

pytestmark = pytest.mark.slow
PROMPT = "The same prompt for every job:"
SWITCHED = re.compile(r"switched model from (\S+) to (\S+) in [0-9.]+s: .+")


def _submit(conn: redis.Redis, queue: str, n: int) -> str:
    reqs = [Request(prompt=PROMPT, max_tokens=6, custom_id=f"{queue}{i}") for i in range(n)]
    return broker_batches.submit(conn, reqs, queue=queue).batch_id


def _each_once(conn: redis.Redis, batch_id: str, n: int) -> list[Result]:
    """Every job of the batch finished, each with exactly one result; the results."""
    broker_batches.wait_for_batch(conn, batch_id, timeout=180)
    status = broker_batches.batch_status(conn, batch_id)
    assert (status.total, status.finished, status.queued, status.started) == (n, n, 0, 0), status
    ids = broker_batches.batch_job_ids(conn, batch_id)
    assert [conn.xlen(rq_keys.results_key(j)) for j in ids] == [1] * n
    return list(broker_batches.iter_batch_results(conn, batch_id))


def _switches(log: Path) -> list[tuple[str, str]]:
    return [(Path(a).name, Path(b).name) for a, b in SWITCHED.findall(log.read_text())]


def _published(conn: redis.Redis, model: str, timeout: float = 30) -> None:
    """Until the worker's record says ``model`` is loaded and it is running."""
    deadline = time.monotonic() + timeout
    while (info := fleet.live_workers(conn)[0]).model != model or info.state != "running":
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def _metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    lines = body.decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_one_worker_serves_two_models_and_switches_between_their_queues(
    valkey_url: str, conn: redis.Redis, two_models: tuple[str, str], tmp_path: Path
):
    alpha, beta = two_models
    port = free_port()
    log = tmp_path / "worker.log"
    args = ("--model", beta, "--min-model-seconds", "0", "--metrics-port", str(port))
    worker = Worker(valkey_url, alpha, *args, log=log)
    try:
        worker.wait_listening(conn)
        (info,) = fleet.live_workers(conn)
        assert (info.model, info.models) == (alpha, [alpha, beta])
        assert info.queues == ["alpha", "beta", "default"]  # a submit sees both served
        table = run_mlxq("workers", url=valkey_url)
        assert "alpha (+beta)" in table.stdout, table.stdout
        wait_blocked(conn)

        # Both models' queues and the shared one at once; beta's only after.
        sizes = {"alpha": 20, "beta": 20, "default": 6}
        batches = {queue: _submit(conn, queue, n) for queue, n in sizes.items()}
        results = {queue: _each_once(conn, b, sizes[queue]) for queue, b in batches.items()}
        text = {}
        for queue in ("alpha", "beta"):
            assert {r.model for r in results[queue]} == {alpha if queue == "alpha" else beta}
            (text[queue],) = {r.text for r in results[queue]}  # one greedy answer per model
        assert text["alpha"] != text["beta"]  # (different weights)
        for r in results["default"]:  # whichever model was loaded, truthfully named
            assert r.model in (alpha, beta)
            assert r.text == text[Path(r.model).name]
        switches = _switches(log)
        assert ("alpha", "beta") in switches, log.read_text()

        # Idle, then work for the model that is not loaded (or is): served, one switch at most.
        wait_blocked(conn)
        loaded = Path(fleet.live_workers(conn)[0].model).name
        other = "beta" if loaded == "alpha" else "alpha"
        again = _each_once(conn, _submit(conn, other, 5), 5)
        assert {r.text for r in again} == {text[other]}
        assert _switches(log)[-1] == (loaded, other), log.read_text()
        assert _metric(port, "mlxq_model_switches_total") == len(_switches(log))
        _published(conn, alpha if other == "alpha" else beta)
    finally:
        out = worker.stop()
    assert worker.proc.returncode == 0, out
    assert "Traceback" not in out, out


def test_a_profile_names_the_models(
    valkey_url: str, conn: redis.Redis, two_models: tuple[str, str], tmp_path: Path
):
    """`models = [...]` in a profile; `--queue` names: a model's own queue name is that
    model's, any other queue is served by whichever model is loaded."""
    alpha, beta = two_models
    profile = tmp_path / "two.toml"
    profile.write_text(f"models = {json.dumps([beta, alpha])}\nmin_model_seconds = 0\n")
    log = tmp_path / "worker.log"
    cmd = [sys.executable, "-m", "mlxq", "worker", "--profile", str(profile), "--max-batch", "4"]
    proc = subprocess.Popen(
        [*cmd, "-q", "alpha", "-q", "jobs"],
        cwd=ROOT,
        env={**os.environ, "MLXQ_REDIS_URL": valkey_url},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not fleet.live_workers(conn):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        (info,) = fleet.live_workers(conn)
        assert (info.model, info.models, info.queues) == (beta, [beta, alpha], ["alpha", "jobs"])
        shared = _each_once(conn, _submit(conn, "jobs", 4), 4)
        assert {r.model for r in shared} == {beta}  # beta loaded: it serves the shared queue
        own = _each_once(conn, _submit(conn, "alpha", 4), 4)
        assert {r.model for r in own} == {alpha}
        assert _switches(log) == [("beta", "alpha")], log.read_text()
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, log.read_text()
