"""Helpers the test files share (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_mlxq(
    *args: str, url: str | None = None, timeout: float = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m mlxq ARGS`` from the checkout, as a user would, capturing output."""
    env = dict(os.environ if env is None else env)
    if url is not None:
        env["MLXQ_REDIS_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "mlxq", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    """A loopback port nothing listens on (right now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Wait until a server we started accepts connections on ``port``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
