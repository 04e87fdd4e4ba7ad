"""``mlxq run`` stopped as a user stops it (Ctrl-C, a second Ctrl-C, SIGTERM) and run
again: the worker stops cleanly while its embedded server outlives it and saves, one line
says how to resume, and the same command continues where it stopped: every request has
exactly one result, none was generated twice, and the output is in input order."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
from helpers import run_mlxq, start_until

from mlxq.broker import batches

ENV = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}  # an embedded Valkey
N = 8
# Two decoding, one more held: most of the batch is still queued when the run is stopped.
FEW = ["--max-batch", "2", "--prefill-batch", "1"]
# Each request's max_tokens: four waves of two, each long beside the 50 ms the tests poll at,
# so a run is stopped with requests running and queued.
LONG = 500


def _inputs(tmp_path: Path, max_tokens: int) -> Path:
    src = tmp_path / "in.jsonl"
    lines = [{"custom_id": f"r{i}", "prompt": f"p{i}", "max_tokens": max_tokens} for i in range(N)]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return src


def _start(args: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    """Start ``mlxq run ARGS``; the process and its batch id (once it runs requests)."""
    proc, found = start_until(("run", *args), env, r"^running \d+ requests on .* \(batch (b\w+)\)")
    return proc, found.group(1)


def _server_of(data_dir: Path) -> redis.Redis:
    """A client of the run's embedded Valkey (its port is in the folder's config)."""
    port = re.search(r"^port (\d+)$", (data_dir / "valkey.conf").read_text(), re.M)
    assert port is not None
    return redis.Redis(port=int(port.group(1)))


def _wait_done(conn: redis.Redis, batch_id: str, at_least: int, proc: subprocess.Popen) -> None:
    """Until ``at_least`` requests are done and others run."""
    deadline = time.monotonic() + 120
    while True:
        s = batches.batch_status(conn, batch_id)
        if s.done >= at_least and s.started:
            return
        assert proc.poll() is None and time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


def _stop(proc: subprocess.Popen, signals: list[signal.Signals]) -> tuple[int, dict, str]:
    """Send ``signals`` (a moment apart); the exit status, --json summary and stderr."""
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.3)  # the first is handled (no new jobs) before the second comes
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=240)
    return proc.returncode, json.loads(out), err


def _lock_is_free(data_dir: Path) -> bool:
    """Whether no server holds the data folder (its Valkey stopped)."""
    fd = os.open(data_dir / "mlxq-server.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _check_clean_stop(code: int, err: str) -> None:
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert "requests not done; run the same command again to resume" in last, err
    for noise in ("Traceback", "could not", "connect", "retrying", "--wait"):
        assert noise not in err, err


def _check_resumed(out: Path, first: dict, second: dict, batch_id: str, err: str) -> None:
    assert second["batch_id"] == batch_id and second["done_before"] == first["finished"], err
    assert first["ran"] + second["ran"] == N  # none generated twice
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == [f"r{i}" for i in range(N)]  # each once, in order
    generated = sum(r["usage"]["completion_tokens"] for r in rows)
    assert generated == first["generated_tokens"] + second["generated_tokens"]


@pytest.mark.parametrize(
    "signals",
    [[signal.SIGINT], [signal.SIGTERM], [signal.SIGINT, signal.SIGINT]],
    ids=["ctrl-c", "sigterm", "ctrl-c-twice"],
)
def test_a_stopped_run_resumes_where_it_stopped(tmp_path, tiny_model, signals):
    src, out, data = _inputs(tmp_path, LONG), tmp_path / "out.jsonl", tmp_path / "data"
    args = [str(src), "--model", tiny_model, "-o", str(out), *FEW]
    args += ["--data-dir", str(data), "--json", "--log-level", "info"]
    proc, batch_id = _start(args, ENV)
    _wait_done(_server_of(data), batch_id, 2, proc)  # 2 done, 2-3 held, the rest queued
    code, first, err = _stop(proc, signals)
    _check_clean_stop(code, err)
    assert _lock_is_free(data) and not out.exists()
    assert first["ran"] < N and first["finished"] == first["ran"]
    # A first signal lets running requests finish (those only pulled go back at once); a
    # second puts the running ones back too.
    put_back = re.findall(r"put job \S+ back on run-", err)
    if len(signals) == 2:
        assert put_back, err
    else:
        assert first["ran"] >= 3, err  # those running when it came finished
    again = run_mlxq("run", *args, env=ENV)
    assert again.returncode == 0, again.stderr
    before = f"resuming batch {batch_id}: {first['finished']} of {N} requests were done before"
    assert before in again.stderr
    _check_resumed(out, first, json.loads(again.stdout), batch_id, again.stderr)
    assert _lock_is_free(data)  # the explicit --data-dir stays, its server stopped


def test_the_same_command_resumes_from_its_own_folder_then_removes_it(tmp_path, tiny_model):
    """No --data-dir: the run keeps its batch under ~/.mlxq/run until the output is written."""
    env = {**ENV, "HOME": str(tmp_path / "home")}
    src, out = _inputs(tmp_path, LONG), tmp_path / "answers.jsonl"
    args = [str(src), "--model", tiny_model, "-o", str(out), *FEW, "--json"]
    proc, batch_id = _start(args, env)
    runs = tmp_path / "home" / ".mlxq" / "run"
    (folder,) = runs.iterdir()
    assert folder.name.startswith("in-")  # named after the input file
    _wait_done(_server_of(folder), batch_id, 1, proc)
    code, first, err = _stop(proc, [signal.SIGINT])
    _check_clean_stop(code, err)
    assert f"(what is done is kept in {folder})" in err.strip().splitlines()[-1]
    again = run_mlxq("run", *args, env=env)
    assert again.returncode == 0, again.stderr
    assert f"resuming batch {batch_id}" in again.stderr
    _check_resumed(out, first, json.loads(again.stdout), batch_id, again.stderr)
    assert list(runs.iterdir()) == []  # written: nothing left to resume
    fresh = run_mlxq("run", *args, env=env)  # a later run of the same file starts anew
    assert fresh.returncode == 0 and "resuming" not in fresh.stderr, fresh.stderr
    assert json.loads(fresh.stdout)["ran"] == N


def test_no_resume_starts_anew(tmp_path, tiny_model):
    src, out, data = _inputs(tmp_path, LONG), tmp_path / "out.jsonl", tmp_path / "data"
    args = [str(src), "-o", str(out), *FEW, "--data-dir", str(data), "--json"]
    proc, batch_id = _start([*args, "--model", tiny_model], ENV)
    _wait_done(_server_of(data), batch_id, 1, proc)
    code, _, err = _stop(proc, [signal.SIGINT])
    _check_clean_stop(code, err)
    fresh = run_mlxq("run", *args, "--model", tiny_model, "--no-resume", env=ENV)
    assert fresh.returncode == 0, fresh.stderr
    summary = json.loads(fresh.stdout)
    assert summary["batch_id"] != batch_id and summary["ran"] == N
    assert "resuming" not in fresh.stderr


def test_a_killed_run_resumes_with_what_its_worker_held(tmp_path, tiny_model):
    """SIGKILL (an OOM kill): no handler runs, the worker's jobs stay registered to it. The
    rerun takes them back at once (no other worker of its own server can live) and ends
    with every request done once, in order."""
    src, out, data = _inputs(tmp_path, LONG), tmp_path / "out.jsonl", tmp_path / "data"
    args = [str(src), "--model", tiny_model, "-o", str(out), *FEW]
    args += ["--data-dir", str(data), "--json"]
    proc, batch_id = _start(args, ENV)
    _wait_done(_server_of(data), batch_id, 2, proc)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while not _lock_is_free(data):  # its Valkey goes with it
        assert time.monotonic() < deadline, "the killed run's Valkey still holds the folder"
        time.sleep(0.1)
    again = run_mlxq("run", *args, env=ENV)
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    assert second["batch_id"] == batch_id and second["ran"] == N - second["done_before"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == [f"r{i}" for i in range(N)]
