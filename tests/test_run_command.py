"""``mlxq run`` as a user runs it (a subprocess, its own embedded Valkey): failed requests
make it exit non-zero with their reasons in one line, a SIGINT or SIGTERM says how to get
what it left undone (test_run_resume.py resumes it), ``--log-level info`` shows the
worker's decisions, and the output's suffix (or --format) picks how results are written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import run_mlxq, start_until

ENV = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}  # an embedded Valkey


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_failed_requests_exit_non_zero_with_their_reasons(tmp_path, tiny_model):
    src = _write(
        tmp_path / "in.jsonl",
        [
            {"custom_id": "ok", "prompt": "Hi", "max_tokens": 4},
            {"custom_id": "long1", "prompt": "Hi", "max_tokens": 5000},
            {"custom_id": "long2", "prompt": "Hello there", "max_tokens": 5000},
        ],
    )
    out = tmp_path / "out.jsonl"
    run = run_mlxq("run", str(src), "--model", tiny_model, "-o", str(out), "--json", env=ENV)
    assert run.returncode == 1, run.stderr
    assert json.loads(run.stdout)["failed"] == 2  # the summary still comes, for scripts
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["ok"]["finish_reason"] != "error" and rows["long1"]["finish_reason"] == "error"
    # The tiny model's context is 2048: max_tokens alone is over it, whatever the prompt.
    assert (
        "lower max_tokens to at most 2045 (alone it exceeds the context)"
        in (rows["long1"]["error"])
    )
    assert "shorten the prompt" not in rows["long1"]["error"]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxq: error: 2 of 3 requests failed: 2x the prompt is ")
    assert last.endswith(f"(error lines in {out})")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_says_how_to_get_the_rest(tmp_path, tiny_model, sig):
    src = _write(
        tmp_path / "in.jsonl", [{"prompt": f"p{i}", "max_tokens": 1500} for i in range(40)]
    )
    out, few = tmp_path / "out.jsonl", ["--max-batch", "2", "--data-dir", str(tmp_path / "d")]
    args = ("run", str(src), "--model", tiny_model, "-o", str(out), *few)
    proc, _ = start_until(args, ENV, "^running ", subprocess.DEVNULL)
    proc.send_signal(sig)
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert proc.wait(240) == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("mlxq: error: interrupted with "), err
    assert "not done; run the same command again to resume" in last, err
    assert "--wait" not in err and "Traceback" not in err and not out.exists()


def test_log_level_info_shows_the_workers_decisions(tmp_path, tiny_model):
    src = _write(tmp_path / "in.jsonl", [{"prompt": "Hi", "max_tokens": 2}])
    args = ("run", str(src), "--model", tiny_model, "-o", str(tmp_path / "out.jsonl"))
    quiet = run_mlxq(*args, env=ENV)
    told = run_mlxq(*args, "--log-level", "info", env=ENV)
    assert quiet.returncode == told.returncode == 0, quiet.stderr + told.stderr
    assert " INFO " not in quiet.stderr  # the default: a progress bar, no per-job lines
    assert " INFO mlxq.worker: device: " in told.stderr
    assert " INFO mlxq.worker: model: " in told.stderr
