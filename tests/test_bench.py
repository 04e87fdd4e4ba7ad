"""Benchmark scripts still run: their short modes, as a user would start them."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def test_queue_overhead_short_mode_runs(valkey_url: str) -> None:
    # The stub engine behind a real worker and Redis: the script must keep up with the
    # engine interface (it once lacked take_stream and prefill_length and stopped running).
    out = subprocess.run(
        [sys.executable, "bench/queue_overhead.py", "--short", "--redis-url", valkey_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "(a) submit: 200 jobs" in out.stdout
    assert "mlxq worker" in out.stdout and "only" not in out.stdout


def test_throughput_runs_a_varied_workload_and_its_twin(valkey_url: str, tmp_path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "bench/throughput.py",
            "--preset",
            "tiny",
            "--requests",
            "6",
            "--batch",
            "2",
            "--workload",
            "varied,varied-twin",
            "--modes",
            "raw,mlxq,mlxq-bg",
            "--redis-url",
            valkey_url,
            "--export-jsonl",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "varied vs its uniform twin (gen tok/s): raw" in out.stdout
    assert "!" not in out.stdout  # every mode returned every token
    lines = (tmp_path / "varied.jsonl").read_text().splitlines()
    assert len(lines) == 6 and '"custom_id": "r0"' in lines[0]
