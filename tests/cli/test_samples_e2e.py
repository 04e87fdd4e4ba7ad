"""``n`` samples end to end as a user runs them: a JSONL file with ``n`` (mlxq lines and
OpenAI batch lines) through ``mlxq submit``, a real worker, and ``mlxq results`` in
mlxq's shape, OpenAI's and a table."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_mlxq

pytestmark = pytest.mark.slow

LINES = [
    {"custom_id": "greedy", "prompt": "The quick brown fox", "max_tokens": 10, "n": 3},
    {"custom_id": "one", "prompt": "The quick brown fox", "max_tokens": 10},
    {
        "custom_id": "seeded",
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 5,
        "n": 4,
    },
    {
        "custom_id": "oa-chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "temperature": 0.7},
    },
]


def test_a_file_with_n_through_a_worker(tiny_model, valkey_url, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    env = {**os.environ, "MLXQ_REDIS_URL": valkey_url}
    sub = run_mlxq("submit", str(src), "--queue", "samples", env=env)
    assert sub.returncode == 0, sub.stderr
    batch_id = sub.stdout.strip().split()[-1]
    args = ["worker", "--model", tiny_model, "-q", "samples", "--burst", "--max-batch", "4"]
    worker = subprocess.run(
        [sys.executable, "-m", "mlxq", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert worker.returncode == 0, worker.stdout + worker.stderr

    out = tmp_path / "out.jsonl"
    assert run_mlxq("results", batch_id, "-o", str(out), env=env).returncode == 0
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    greedy, one, seeded = results["greedy"], results["one"], results["seeded"]
    assert one["choices"] is None
    assert [c["token_ids"] for c in greedy["choices"]] == [one["token_ids"]] * 3
    assert greedy["text"] == one["text"] and greedy["token_ids"] == one["token_ids"]
    assert greedy["usage"]["completion_tokens"] == 3 * len(one["token_ids"])
    assert greedy["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    samples = [tuple(c["token_ids"]) for c in seeded["choices"]]
    assert [c["index"] for c in seeded["choices"]] == [0, 1, 2, 3] and len(set(samples)) == 4
    assert seeded["token_ids"] == list(samples[0])
    assert seeded["usage"]["completion_tokens"] == sum(map(len, samples))

    openai_out = tmp_path / "openai.jsonl"
    got = run_mlxq("results", batch_id, "--format", "openai", "-o", str(openai_out), env=env)
    assert got.returncode == 0, got.stderr
    lines = {x["custom_id"]: x for x in map(json.loads, openai_out.read_text().splitlines())}
    chat = lines["oa-chat"]["response"]["body"]["choices"]
    assert [c["index"] for c in chat] == [0, 1] and all(c["message"]["content"] for c in chat)
    assert len(lines["seeded"]["response"]["body"]["choices"]) == 4
    assert len(lines["one"]["response"]["body"]["choices"]) == 1

    table = tmp_path / "out.csv"
    assert run_mlxq("results", batch_id, "-o", str(table), env=env).returncode == 0
    rows = list(csv.DictReader(table.open()))
    assert [(r["custom_id"], r["choice"]) for r in rows[:5]] == [
        ("greedy", "0"),
        ("greedy", "1"),
        ("greedy", "2"),
        ("one", "0"),
        ("seeded", "0"),
    ]
    assert len(rows) == 3 + 1 + 4 + 2
