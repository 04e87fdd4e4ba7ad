"""The command line as scripts use it: --json everywhere, exit codes, one-line errors, logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    assert lines and not [x for x in lines if not _json_log(x)], work.stderr

    done = run_mlxq("results", batch, url=valkey_url)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 3
    assert json.loads(run_mlxq("retry", batch, "--json", url=valkey_url).stdout) == {"requeued": 0}
    cancel = json.loads(run_mlxq("cancel", batch, "--json", url=valkey_url).stdout)
    assert cancel == {"removed": 0, "stopping": 0}
    assert json.loads(run_mlxq("workers", "--json", url=valkey_url).stdout) == []


def _json_log(line: str) -> bool:
    """Whether ``line`` is a log record of ``--log-format json``."""
    try:
        return bool(json.loads(line)["level"])
    except (ValueError, KeyError, TypeError):
        return False


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
    engine = summary["engine"]  # where the time went
    assert engine["decode_steps"] > 0 and engine["prefill_calls"] > 0, engine
    assert engine["generated_tokens"] == summary["generated_tokens"], engine


def test_results_in_openai_batch_format_with_an_errors_file(valkey_url, conn, tmp_path, tiny_model):
    src = tmp_path / "oa.jsonl"
    lines = [
        {
            "custom_id": "ok",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": tiny_model,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
        },
        {"custom_id": "bad", "prompt": [1, 999999], "max_tokens": 4},
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    batch = json.loads(
        run_mlxq(
            "submit", str(src), "--queue", "oa", "--model", tiny_model, "--json", url=valkey_url
        ).stdout
    )["batch_id"]
    assert (
        run_mlxq("worker", "--model", tiny_model, "-q", "oa", "--burst", url=valkey_url).returncode
        == 0
    )
    out = tmp_path / "out.jsonl"
    res = run_mlxq("results", batch, "--format", "openai", "-o", str(out), url=valkey_url)
    assert res.returncode == 0, res.stderr
    ok = [json.loads(x) for x in out.read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "out_errors.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in ok] == ["ok"] and ok[0]["error"] is None
    body = ok[0]["response"]["body"]
    assert ok[0]["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert [x["custom_id"] for x in errors] == ["bad"] and errors[0]["response"] is None
    assert "vocabulary" in errors[0]["error"]["message"]


def test_rq_info_shows_mlxq_queues_and_workers(valkey_url, conn, tiny_model):
    from mlxq.broker import batches
    from mlxq.wire import Request
    from mlxq.worker.launch import run_worker
    from mlxq.worker.profile import WorkerProfile

    batches.submit(conn, [Request(prompt=f"p{i}", max_tokens=3) for i in range(4)], queue="rqi")
    seen = []

    def on_finish(_result) -> None:
        if not seen:  # while the worker is alive, ask RQ's own CLI
            rq = Path(sys.executable).with_name("rq")
            seen.append(
                subprocess.run(
                    [
                        str(rq),
                        "info",
                        "-u",
                        valkey_url,
                        "--serializer",
                        "mlxq.serializer.JSONSerializer",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            )

    run_worker(
        WorkerProfile(model=tiny_model, max_batch=2, name="rq-visible"),
        conn,
        burst=True,
        queues=["rqi"],
        on_finish=on_finish,
    )
    info = seen[0]
    assert info.returncode == 0, info.stderr
    assert "rqi" in info.stdout and "rq-visible" in info.stdout and "1 workers" in info.stdout


def test_run_with_a_quantized_kv_cache(tmp_path, batch_file):
    env = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}
    wide = tmp_path / "wide"
    assert (
        run_mlxq("make-model", str(wide), "--preset", "tiny-wide-heads", url=None).returncode == 0
    )
    out = tmp_path / "out.jsonl"
    args = ("run", str(batch_file), "-o", str(out), "--json", "--kv-bits", "8")
    run = run_mlxq(*args, "--model", str(wide), "--log-level", "debug", env=env)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["finished"] == 3
    assert "8-bit cache" in run.stderr and "8-bit quantized decode attention" in run.stderr
    # Heads of 16 values cannot be quantized in groups: refused at start, in one line.
    narrow = tmp_path / "narrow"
    assert run_mlxq("make-model", str(narrow), url=None).returncode == 0
    refused = run_mlxq(*args, "--model", str(narrow), env=env)
    errors = [x for x in refused.stderr.splitlines() if x.startswith("mlxq: error:")]
    assert refused.returncode == 1 and len(errors) == 1 and "multiple of 32" in errors[0]
    assert "Traceback" not in refused.stderr
