"""A worker over two ranks (`mlxq worker --hosts`, tensor or pipeline parallel) when a rank
dies, hangs or freezes mid-batch as hosts do: the jobs go back or stay with whoever
finished them, none lost or run twice, and the ranks left end by themselves."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from mlxq.broker import batches
from mlxq.cli.worker import STALLED_EXIT
from mlxq.worker.sharing import process_running
from tests.engine.test_distributed import SPLITS, once_each, submit, tp_model
from tests.helpers import ROOT, Worker, run_mlxq

__all__ = ["tp_model"]  # (the fixture, shared with the tests of a healthy split)
STALL_S = 8
# Each job's max_tokens: enough to be running when a rank is signalled (the signal goes as
# the first job starts; a job that finished first keeps its one result all the same), and
# few enough that the batch's rerun elsewhere is short.
TOKENS = 300
# Heartbeats that lapse this soon let the frozen rank 0's rescue take its jobs back without
# the default's 30 s wait (what is tested is the wake-up after, not the wait).
ABANDON = ("--abandon-after", "5")
# How long past the stall timeout a rank may take to notice, put the jobs back and exit:
# generous, as a loaded CI machine is slow at all of it (this bounds "it ends by itself",
# not a speed).
GRACE_S = 90


@pytest.mark.slow
def test_a_killed_rank_puts_the_jobs_back(
    tp_model: str, conn: redis.Redis, valkey_url: str, tp_worker: subprocess.Popen
):
    n = 16
    batch = submit(conn, n, TOKENS)
    worker = tp_worker  # (started before the jobs, as users run it)
    _signal_mid_batch(conn, batch, worker, 1, signal.SIGKILL)
    started = time.monotonic()
    code, err = _jobs_back_on_exit(conn, batch, n, worker, started)
    # MLX's ring fails the collective of a lost peer at once, or at times hangs in it
    # (then the stall watchdog ends it): non-zero within the stall timeout, either way.
    assert code in (1, STALLED_EXIT), err
    # The MLX thread's error is logged with its traceback; the command ends in one line.
    assert err.count("Traceback") == err.count("MLX thread stopped on an unexpected error"), err
    _run_elsewhere(tp_model, conn, valkey_url, batch, n)  # (none lost, none run twice)


@pytest.mark.slow
def test_a_hung_rank_0_makes_the_other_ranks_exit(
    tp_model: str, conn: redis.Redis, valkey_url: str, tp_worker: subprocess.Popen
):
    """Rank 0 stopped (SIGSTOP: hung, as a frozen host) fails no collective on rank 1:
    rank 1 gives up after rank 0's stall timeout and two pings and exits non-zero; rank 0,
    let go, finds its peer gone, puts its jobs back and exits; none is lost or run twice."""
    n = 8
    batch = submit(conn, n, TOKENS)
    worker = tp_worker  # (started before the jobs, as users run it)
    follower = _rank(worker.pid, 1)
    leader = _signal_mid_batch(conn, batch, worker, 0, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        while process_running(follower):
            assert time.monotonic() - stopped < STALL_S + GRACE_S, "rank 1 waited on forever"
            time.sleep(0.2)
        assert time.monotonic() - stopped > STALL_S  # (not before rank 0's own patience)
    finally:
        os.kill(leader, signal.SIGCONT)
    code = _wait(worker)
    err = _err(worker)
    assert code in (1, STALLED_EXIT), err
    assert "no word from rank 0" in err, err
    _run_elsewhere(tp_model, conn, valkey_url, batch, n)


@pytest.mark.slow
def test_a_hung_rank_makes_rank_0_put_the_jobs_back(
    tp_model: str, conn: redis.Redis, valkey_url: str, tp_worker: subprocess.Popen
):
    """A rank stopped mid-batch (SIGSTOP: a frozen host) fails nothing: rank 0's stall
    watchdog puts the jobs back and the command exits non-zero, the stopped rank ended
    with it; none is lost or run twice."""
    n = 8
    batch = submit(conn, n, TOKENS)
    worker = tp_worker  # (started before the jobs, as users run it)
    follower = _signal_mid_batch(conn, batch, worker, 1, signal.SIGSTOP)
    stopped = time.monotonic()
    code, err = _jobs_back_on_exit(conn, batch, n, worker, stopped)
    assert code == STALLED_EXIT, err
    assert not process_running(follower), "the stopped rank was left behind"
    _run_elsewhere(tp_model, conn, valkey_url, batch, n)


@pytest.mark.slow
def test_a_frozen_rank_0_woken_after_a_rescue_finished_its_jobs_runs_none_twice(
    tp_model: str,
    conn: redis.Redis,
    valkey_url: str,
    tp_worker: subprocess.Popen,
    tmp_path: Path,
):
    """Rank 0 frozen mid-batch (a Mac asleep) past every timeout; a one-process worker
    takes its jobs back and finishes them, and rank 1 gives up on rank 0; then rank 0
    wakes, puts back nothing that the rescue finished (every job keeps one result), finds
    its peer gone and exits (a call that waits on the gone rank, a ping or the cache's
    clearing once the batch emptied, can hang in MLX's ring: the stall watchdog ends it)."""
    n = 16
    batch = submit(conn, n, TOKENS)
    worker = tp_worker  # (started before the jobs, as users run it)
    follower = _rank(worker.pid, 1)
    leader = _signal_mid_batch(conn, batch, worker, 0, signal.SIGSTOP)
    frozen = time.monotonic()
    rescue = Worker(valkey_url, tp_model, *ABANDON, log=tmp_path / "rescue.log")  # long-lived
    try:
        try:  # it takes the jobs back once rank 0's heartbeats lapse (--abandon-after)
            batches.wait_for_batch(conn, batch, timeout=300)
            while process_running(follower):  # (asleep past rank 1's patience too)
                assert time.monotonic() - frozen < STALL_S + GRACE_S, "rank 1 waited on"
                time.sleep(0.2)
        finally:
            os.kill(leader, signal.SIGCONT)
        code = _wait(worker)
        err = _err(worker)
        assert "were taken back while it was away" in err, err[-3000:]
        assert code in (1, STALLED_EXIT), err[-3000:]
        once_each(conn, batch, n)  # nothing put back: no job runs again, or twice
    finally:
        rescue.stop()


def _signal_mid_batch(
    conn: redis.Redis, batch: str, worker: subprocess.Popen, rank: int, sig: int
) -> int:
    """Send ``sig`` to ``rank`` of the worker once the batch's jobs run; its pid."""
    pid = _rank(worker.pid, rank)
    while batches.batch_status(conn, batch).started == 0:
        assert worker.poll() is None, _err(worker)
        time.sleep(0.05)
    os.kill(pid, sig)
    return pid


def _jobs_back_on_exit(
    conn: redis.Redis, batch: str, n: int, worker: subprocess.Popen, since: float
) -> tuple[int, str]:
    """The worker's exit status and stderr, once it ended by itself within the stall
    timeout and its grace of ``since``, every job of the batch queued or finished."""
    code = _wait(worker)
    err = _err(worker)
    assert time.monotonic() - since < STALL_S + GRACE_S, err
    status = batches.batch_status(conn, batch)
    assert status.started == 0 and status.queued + status.finished == n, (status, err)
    return code, err


def _run_elsewhere(
    tp_model: str, conn: redis.Redis, valkey_url: str, batch: str, n: int, *args: str
):
    """A one-process worker finishes the batch: each job has exactly one result."""
    done = run_mlxq(
        "worker",
        "--model",
        tp_model,
        "-q",
        "default",
        *args,
        "--burst",
        url=valkey_url,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    once_each(conn, batch, n)


@pytest.fixture(params=SPLITS)
def tp_worker(
    tp_model: str, valkey_url: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[subprocess.Popen]:
    """A long-lived `mlxq worker --hosts` of two ranks on this machine, tensor or pipeline
    parallel, its stderr in a file (a pipe nobody reads would fill and block the ranks);
    its whole process group is killed at the end, whatever the test left running."""
    args = ["worker", "--model", tp_model, "--max-batch", "4", "-q", "default"]
    args += ["--stall-timeout", str(STALL_S), *ABANDON, "--hosts", "127.0.0.1,127.0.0.1"]
    args += ["--parallel", request.param]
    log = tmp_path / "tp-worker.log"
    with log.open("w") as err:
        worker = subprocess.Popen(
            [sys.executable, "-m", "mlxq", *args],
            cwd=ROOT,
            env={**os.environ, "MLXQ_REDIS_URL": valkey_url},
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    LOGS[worker.pid] = log
    yield worker
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(30)


LOGS: dict[int, Path] = {}


def _err(worker: subprocess.Popen) -> str:
    """What the ``tp_worker`` wrote to stderr so far."""
    return LOGS[worker.pid].read_text()


def _wait(worker: subprocess.Popen) -> int:
    """The ``tp_worker``'s exit status, once it ended by itself (past the stall timeout
    and its grace, it failed to: its log says where it was)."""
    try:
        return worker.wait(STALL_S + GRACE_S + 30)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the worker did not exit:\n{_err(worker)[-4000:]}") from e


def _rank(launcher: int, rank: int, timeout: float = 60) -> int:
    """The pid of ``rank`` among the launcher's children (its environment says MLX_RANK)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"MLX_RANK={rank}".encode() in env:
                return int(pid)
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} was started")
