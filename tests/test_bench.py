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
