"""The command line as scripts use it: --json everywhere, exit codes, one-line errors, logs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import run_mlxq


@pytest.fixture
def batch_file(tmp_path: Path) -> Path:
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "max_tokens": 3}) + "\n" for i in range(3))
    )
    return src


def test_json_outputs_and_exit_codes(valkey_url, conn, batch_file, tiny_model):
    sub = run_mlxq("submit", str(batch_file), "--queue", "cq", "--json", url=valkey_url)
    assert sub.returncode == 0, sub.stderr
    info = json.loads(sub.stdout)
    assert info["total"] == 3 and info["queue"] == "cq"
    batch = info["batch_id"]

    status = json.loads(run_mlxq("status", batch, "--json", url=valkey_url).stdout)
    assert {"total", "queued", "started", "finished", "failed"} <= status.keys()
    overview = json.loads(run_mlxq("status", "--json", url=valkey_url).stdout)
    assert any(row["name"] == "cq" and row["queued"] == 3 for row in overview)

    early = run_mlxq("results", batch, url=valkey_url)
    assert early.returncode == 1 and "not done yet" in early.stderr
    assert len(early.stderr.strip().splitlines()) == 1

    work = run_mlxq(
        "worker",
        "--model",
        tiny_model,
        "-q",
        "cq",
        "--burst",
        "--log-format",
        "json",
        url=valkey_url,
    )
    assert work.returncode == 0, work.stderr
    lines = [x for x in work.stderr.splitlines() if x.strip()]
    assert lines and all(json.loads(x)["level"] for x in lines)

    done = run_mlxq("results", batch, url=valkey_url)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 3
    assert json.loads(run_mlxq("retry", batch, "--json", url=valkey_url).stdout) == {"requeued": 0}
    cancel = json.loads(run_mlxq("cancel", batch, "--json", url=valkey_url).stdout)
    assert cancel == {"removed": 0, "stopping": 0}
    assert json.loads(run_mlxq("workers", "--json", url=valkey_url).stdout) == []


def test_errors_are_one_line_with_a_fix(valkey_url, conn):
    missing = run_mlxq("status", "bnope", url=valkey_url)
    assert missing.returncode == 1
    assert missing.stderr.startswith("mlxq: error: no batch 'bnope'")
    down = run_mlxq("status", "x", url="redis://127.0.0.1:1/0")
    assert down.returncode == 1 and "mlxq server" in down.stderr
    assert len(down.stderr.strip().splitlines()) == 1
    nomodel = run_mlxq("worker", url=valkey_url)
    assert nomodel.returncode == 1 and "--model" in nomodel.stderr


def test_run_and_make_model_print_json_summaries(tmp_path, batch_file):
    made = run_mlxq("make-model", str(tmp_path / "m"), "--json", url=None)
    assert made.returncode == 0, made.stderr
    model = json.loads(made.stdout)["path"]
    env = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}
    out = tmp_path / "out.jsonl"
    run = run_mlxq("run", str(batch_file), "--model", model, "-o", str(out), "--json", env=env)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["total"] == summary["finished"] == 3 and summary["output"] == str(out)
    assert len(out.read_text().splitlines()) == 3
