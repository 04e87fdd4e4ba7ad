"""Helpers the test files share (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parent.parent
# The preset of the tests' model folder (conftest's ``tiny_model_dir``, named for it):
# ``tiny``, or what ``MLXQ_TEST_PRESET`` names for a run elsewhere (``cpu-small`` on a GPU).
TEST_PRESET = os.environ.get("MLXQ_TEST_PRESET", "tiny")


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


def start_submit(url: str, path: Path, queue: str, *args: str) -> tuple[subprocess.Popen, str]:
    """Start ``mlxq submit PATH --queue QUEUE ARGS`` and read the batch id it prints before
    enqueueing; returns the process (stderr piped) and the batch id."""
    args = ("submit", str(path), "--queue", queue, *args)
    env = {**os.environ, "MLXQ_REDIS_URL": url}
    proc, found = start_until(args, env, r"batch (b[0-9a-f]+): enqueueing", subprocess.DEVNULL)
    return proc, found.group(1)


def start_until(
    args: tuple[str, ...], env: dict, pattern: str, stdout: Any = subprocess.PIPE
) -> tuple[subprocess.Popen, re.Match]:
    """Start ``python -m mlxq ARGS`` (stderr piped) and read its stderr until a line
    matches ``pattern``; the process and the match."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxq", *args],
        cwd=ROOT,
        env=env,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(pattern, line)
        if found:
            return proc, found
    proc.wait()
    raise AssertionError(f"mlxq {args[0]} exited ({proc.returncode}) before printing {pattern!r}")


class Worker:
    """A long-lived ``mlxq worker`` process (never ``--burst`` unless ARGS say so), its
    log in a file. ``Worker.running`` holds those not stopped yet: conftest stops what a
    failed test left, so one failure cannot leak a worker into the tests after it."""

    running: ClassVar[set[Worker]] = set()

    def __init__(self, url: str, model: str, *args: str, log: Path) -> None:
        self.log = log
        cmd = [sys.executable, "-m", "mlxq", "worker", "--model", model, "--max-batch", "8"]
        self.proc = subprocess.Popen(
            [*cmd, *args],
            cwd=ROOT,
            env={**os.environ, "MLXQ_REDIS_URL": url},
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        Worker.running.add(self)

    def wait_listening(self, conn: Any, timeout: float = 120) -> None:
        """Until the worker has published itself (its model is loaded)."""
        from mlxq.broker import fleet

        deadline = time.monotonic() + timeout
        while not fleet.live_workers(conn):
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.1)

    def stop(self) -> str:
        """SIGTERM (a frozen worker is woken to take it), then SIGKILL after a minute; its log."""
        Worker.running.discard(self)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.log.read_text()


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> float:
    """Until ``pred()`` holds (raises ``AssertionError`` naming ``what`` after ``timeout``
    seconds); the seconds it took."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def wait_blocked(conn: Any, clients: int = 1, timeout: float = 60) -> None:
    """Until ``clients`` connections are blocked on the server: idle workers back in their
    blocking pull (RQ's BLMOVE or BLPOP), whatever the machine's speed."""

    def blocked() -> bool:
        return sum("b" in c["flags"] for c in conn.client_list()) >= clients

    wait_until(blocked, timeout, f"{clients} worker(s) back in a blocking pull")


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


def dequeued(conn: Any, n: int, queue: str, result_ttl: int | None = None) -> tuple[str, Any, list]:
    """``n`` jobs submitted to ``queue`` (as one batch) and dequeued by a live worker with
    no engine: (batch id, worker, [(job, queue)])."""
    from mlxq.broker import batches, keys
    from mlxq.broker.intake import dequeue_many
    from mlxq.wire import Request
    from mlxq.worker.rq_worker import MlxqWorker

    reqs = [Request(prompt=f"p{i}", max_tokens=4, custom_id=f"c{i}") for i in range(n)]
    ttl = keys.DEFAULT_RESULT_TTL if result_ttl is None else result_ttl
    batch = batches.submit(conn, reqs, queue=queue, result_ttl=ttl).batch_id
    worker = MlxqWorker([queue], connection=conn, runner=None, model_name="m")  # type: ignore[arg-type]
    worker.register_birth()
    return batch, worker, dequeue_many(worker, n)


def waiting(conn: Any, queue: str) -> int:
    """How many jobs wait on ``queue``: its RQ list and its batches' lanes."""
    from mlxq.broker.rq_store import lanes

    return lanes.waiting(conn, [queue])[queue]


def worker_record(**fields: Any) -> Any:  # -> WorkerInfo
    """A live worker's record with ``fields`` set and plain values (zeros, ``cpu``) in every
    other required field: what a test publishes or reads without a process behind it."""
    import msgspec

    from mlxq.wire import WorkerInfo

    required = WorkerInfo.__struct_fields__[: -len(WorkerInfo.__struct_defaults__) or None]
    record: dict[str, Any] = dict.fromkeys(required, 0)
    record.update(name="w1", host="h", model="m", queues=[], backend="cpu", device="cpu")
    record.update(recent_tps=0.0, started_at=0.0, heartbeat_at=0.0)
    return msgspec.convert({**record, **fields}, WorkerInfo)
