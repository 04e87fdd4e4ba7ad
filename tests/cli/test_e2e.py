"""End to end as a user runs it: CLI submit, two burst workers, results back exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_mlxq

from tests.helpers import waiting

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def write_mixed(path: Path, model: str) -> list[dict]:
    """mlxq and OpenAI lines; the OpenAI ones name ``model`` (the one the batch is for)."""
    lines = [
        {"custom_id": "text-0", "prompt": "The quick brown fox", "max_tokens": 12},
        {"custom_id": "text-1", "prompt": "Once upon a time there was", "max_tokens": 20},
        {"custom_id": "ids-0", "prompt": [5, 17, 42, 8, 99], "max_tokens": 10},
        {
            "custom_id": "chat-0",
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 16,
        },
        {
            "custom_id": "oa-chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 8,
            },
        },
        {
            "custom_id": "oa-comp",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": "In the beginning", "max_tokens": 9},
        },
    ]
    lines += [
        {
            "custom_id": f"sampled-{i}",
            "prompt": f"Story number {i}:",
            "max_tokens": 14,
            "temperature": 0.8,
            "top_p": 0.9,
            "seed": i,
        }
        for i in range(12)
    ]
    lines += [
        {"custom_id": f"greedy-{i}", "prompt": f"Fact {i} is that", "max_tokens": 11}
        for i in range(12)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def greedy_reference(model_path: str, line: dict) -> list[int]:
    """mlx-lm's own single-request greedy tokens for one input line."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tok = _load(model_path, load)
    body = line.get("body", line)
    if "messages" in body:
        prompt = tok.apply_chat_template(body["messages"], add_generation_prompt=True)
    elif isinstance(body["prompt"], list):
        prompt = body["prompt"]
    else:
        prompt = tok.encode(body["prompt"])
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=body["max_tokens"]):
        if token in tok.eos_token_ids:
            break
        out.append(int(token))
    return out


_cache: dict = {}


def _load(path, load):
    if path not in _cache:
        _cache[path] = load(path)
    return _cache[path]


def test_two_burst_workers_return_every_result_exactly_once(tiny_model, valkey_url, conn, tmp_path):
    src = tmp_path / "mixed.jsonl"
    lines = write_mixed(src, tiny_model)
    env = {**os.environ, "MLXQ_REDIS_URL": valkey_url}
    sub = run_mlxq("submit", str(src), "--queue", "e2e", "--model", tiny_model, env=env)
    assert sub.returncode == 0, sub.stderr
    batch_id = sub.stdout.strip().split()[-1]

    args = ["-q", "e2e", "--burst", "--max-batch", "4", "--prefill-batch", "2"]
    paths = [tmp_path / f"w{i}.log" for i in range(2)]
    workers = []
    for i, path in enumerate(paths):  # (logs in files: a pipe read after the other's could fill)
        with path.open("w") as log:
            cmd = [sys.executable, "-m", "mlxq", "worker", "--model", tiny_model, *args]
            workers.append(
                subprocess.Popen(
                    [*cmd, "--name", f"w{i}"], cwd=ROOT, env=env, stdout=log, stderr=log
                )
            )
    try:
        for w in workers:
            w.wait(300)
    except subprocess.TimeoutExpired as e:
        raise AssertionError([p.read_text() for p in paths]) from e
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    logs = [p.read_text() for p in paths]
    assert all(w.returncode == 0 for w in workers), logs

    status = run_mlxq("status", batch_id, "--json", env=env)
    counts = json.loads(status.stdout)
    assert counts["total"] == len(lines) == counts["finished"], (counts, logs)
    assert counts["queued"] == counts["started"] == counts["failed"] == 0

    out = tmp_path / "results.jsonl"
    res = run_mlxq("results", batch_id, "-o", str(out), env=env)
    assert res.returncode == 0, res.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    assert len({r["job_id"] for r in results}) == len(lines)
    assert {r["worker"] for r in results} <= {"w0", "w1"}
    for r in results:
        assert r["finish_reason"] in ("stop", "length")
        assert r["usage"]["completion_tokens"] == len(r["token_ids"]) > 0
        t = r["timing"]
        assert t["queue_wait_s"] >= 0 and t["ttft_s"] >= 0 and t["finished_at"] >= t["started_at"]

    for line, r in zip(lines, results, strict=True):
        body = line.get("body", line)
        if body.get("temperature", 0) == 0:
            assert r["token_ids"] == greedy_reference(tiny_model, line), line["custom_id"]


def test_run_locally_on_embedded_valkey(tiny_model, tmp_path):
    src = tmp_path / "mixed.jsonl"
    lines = write_mixed(src, tiny_model)
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}
    run = run_mlxq(
        "run", str(src), "--model", tiny_model, "-o", str(out), "--max-batch", "8", env=env
    )
    assert run.returncode == 0, run.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
    assert all(r["finish_reason"] in ("stop", "length") for r in results)


def test_bad_file_is_refused_whole_with_line_numbers(valkey_url, conn, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(
        '{"prompt": "ok", "max_tokens": 4}\n{"prompt": "x", "max_tokens": 0}\nnot json\n'
    )
    env = {**os.environ, "MLXQ_REDIS_URL": valkey_url}
    sub = run_mlxq("submit", str(src), "--queue", "bad", env=env)
    assert sub.returncode != 0
    assert ":2:" in sub.stderr and "max_tokens" in sub.stderr and ":3:" in sub.stderr
    assert "nothing was enqueued" in sub.stderr
    assert waiting(conn, "bad") == 0
