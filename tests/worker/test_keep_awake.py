"""A worker keeps its Mac from idle sleep while, and only while, it holds jobs.

The state machine on its own, then long-lived workers as users run them, seen through the
test-only record (``MLXQ_KEEP_AWAKE_RECORD``) that stands in for IOKit's assertion."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis

from mlxq.broker import batches
from mlxq.wire import Request
from mlxq.worker import keep_awake
from mlxq.worker.keep_awake import RECORD_ENV, KeepAwake, PowerAssertion, Recorded
from mlxq.worker.profile import WorkerProfile, merge
from tests.helpers import Worker


class Counting:
    """An assertion that counts what it was asked to do (and can be made to fail)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def acquire(self) -> None:
        if self.fail:
            raise OSError("refused")
        self.calls.append("acquire")

    def drop(self) -> None:
        self.calls.append("drop")


def test_held_exactly_on_busy_transitions_and_idempotent():
    a = Counting()
    k = KeepAwake(a)
    k.set(False)
    k.release()  # idle from the start: nothing to release
    assert a.calls == [] and not k.held
    for _ in range(3):
        k.set(True)  # every busy pass after the first changes nothing
    k.hold()
    assert a.calls == ["acquire"] and k.held
    k.set(False)
    k.set(False)
    k.release()  # as work()'s finally does after the loop let go
    assert a.calls == ["acquire", "drop"] and not k.held
    k.set(True)
    k.release()  # exiting while busy
    assert a.calls == ["acquire", "drop", "acquire", "drop"]


def test_a_refused_assertion_warns_once_and_the_worker_carries_on(caplog):
    k = KeepAwake(Counting(fail=True))
    with caplog.at_level(logging.WARNING, logger="mlxq.worker"):
        for busy in (True, False, True, True):
            k.set(busy)
    assert not k.held
    assert [r.getMessage() for r in caplog.records] == [
        "cannot keep this Mac awake while it works (refused); carrying on"
    ]


def test_the_factory_picks_by_setting_record_and_system(monkeypatch, tmp_path: Path):
    monkeypatch.delenv(RECORD_ENV, raising=False)
    monkeypatch.setattr(keep_awake.sys, "platform", "linux")
    assert KeepAwake.for_worker(True, "w")._assertion is None  # Linux: a no-op
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "rec"))
    assert isinstance(KeepAwake.for_worker(True, "w")._assertion, Recorded)
    assert KeepAwake.for_worker(False, "w")._assertion is None  # off: nothing, not even this

    monkeypatch.delenv(RECORD_ENV)
    monkeypatch.setattr(keep_awake.sys, "platform", "darwin")  # IOKit cannot load here
    assert KeepAwake.for_worker(True, "w")._assertion is None


def test_the_iokit_calls_take_and_release_one_named_idle_sleep_assertion(monkeypatch):
    """IOKit as ctypes sees it, faked: the type, level and name passed, and the id
    released, are those of ``caffeinate -i``'s assertion."""
    made: dict[int, bytes] = {}
    live: set[int] = set()
    released: list[int] = []

    def create_string(_alloc, text, encoding):
        assert encoding == keep_awake.UTF8
        ref = 1000 + len(made)
        made[ref] = text
        live.add(ref)
        return ref

    def free_string(ref):
        live.remove(ref)

    def create_assertion(kind, level, name, out):
        assert (made[kind], level, made[name]) == (
            b"PreventUserIdleSystemSleep",
            255,
            b"mlxq worker w1: generating",
        )
        out._obj.value = 42  # (ctypes.byref's target)
        return 0

    def release(assertion_id):
        released.append(assertion_id)
        return 0

    libs = {
        keep_awake.CORE_FOUNDATION: SimpleNamespace(
            CFStringCreateWithCString=create_string, CFRelease=free_string
        ),
        keep_awake.IOKIT: SimpleNamespace(
            IOPMAssertionCreateWithName=create_assertion, IOPMAssertionRelease=release
        ),
    }
    monkeypatch.setattr(keep_awake.ctypes, "CDLL", lambda path: libs[path])
    k = KeepAwake(PowerAssertion("mlxq worker w1: generating"))
    k.set(True)
    assert k.held and released == [] and not live  # its strings freed: IOKit keeps its own
    k.set(False)
    assert released == [42] and not k.held
    k.set(False)
    assert released == [42]


def test_the_setting_is_a_profile_key_and_a_flag():
    assert WorkerProfile().keep_awake is True
    assert merge(WorkerProfile(model="m"), {"keep_awake": None}).keep_awake is True
    assert merge(WorkerProfile(model="m", keep_awake=False), {}).keep_awake is False
    assert merge(WorkerProfile(model="m"), {"keep_awake": False}).keep_awake is False


# -- long-lived workers --------------------------------------------------------------------


PROMPT = "Story 0:"


def records(path: Path) -> list[tuple[str, float]]:
    if not path.exists():
        return []
    return [(w, float(t)) for w, t in (line.split() for line in path.read_text().splitlines())]


def wait_for(pred, timeout: float, what: str, worker: Worker) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert worker.proc.poll() is None, worker.log.read_text()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def submit(conn: redis.Redis, n: int, max_tokens: int) -> str:
    """``n`` jobs of one prompt whose greedy output runs to ``max_tokens`` on the tiny
    model (other prompts meet EOS within tens of tokens, before a test can look)."""
    reqs = [Request(prompt=PROMPT, max_tokens=max_tokens, custom_id=f"c{i}") for i in range(n)]
    return batches.submit(conn, reqs, queue="awake").batch_id


@pytest.fixture
def worker(valkey_url: str, tiny_model: str, conn: redis.Redis, tmp_path: Path, monkeypatch):
    """Start ``mlxq worker --model tiny -q awake ARGS`` recording its keep-awake to
    ``tmp_path/awake``; stopped at the end."""
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "awake"))
    started: list[Worker] = []

    def _start(*args: str) -> Worker:
        w = Worker(valkey_url, tiny_model, "-q", "awake", *args, log=tmp_path / "w.log")
        started.append(w)
        w.wait_listening(conn)
        return w

    yield _start
    for w in started:
        w.stop()


@pytest.mark.slow
def test_a_worker_holds_it_while_it_has_jobs_and_releases_it_when_idle(
    worker, conn, tmp_path: Path
):
    record = tmp_path / "awake"
    w = worker()
    time.sleep(1.5)  # idle passes (blocking pulls): nothing held
    assert records(record) == []
    submitted = time.time()
    batch = submit(conn, 4, max_tokens=300)
    status = batches.wait_for_batch(conn, batch, timeout=180)
    assert status.finished == 4, status
    wait_for(lambda: len(records(record)) >= 2, 10, "the release once idle", w)
    finished = [r.timing.finished_at for r in batches.iter_batch_results(conn, batch)]
    assert {r.finish_reason for r in batches.iter_batch_results(conn, batch)} == {"length"}
    (hold, held_at), (release, released_at) = records(record)
    assert (hold, release) == ("hold", "release")
    assert submitted < held_at < min(finished)  # held while the jobs ran, not before
    assert released_at >= max(finished)
    time.sleep(1.5)  # idle again: nothing more
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(60) == 0
    assert [what for what, _ in records(record)] == ["hold", "release"]  # nothing held at exit


@pytest.mark.slow
def test_a_worker_stopped_while_busy_releases_it_at_exit(worker, conn, tmp_path: Path):
    record = tmp_path / "awake"
    w = worker("--grace-period", "0")
    batch = submit(conn, 4, max_tokens=1800)
    wait_for(lambda: records(record), 120, "the hold", w)
    assert batches.batch_status(conn, batch).finished == 0
    stopped_at = time.time()
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(60) == 0, w.log.read_text()
    (hold, _), (release, released_at) = records(record)
    assert (hold, release) == ("hold", "release") and released_at >= stopped_at


@pytest.mark.slow
def test_nothing_outlives_a_worker_killed_while_holding_it(worker, conn, tmp_path: Path):
    """IOKit's assertion belongs to the process: the OS drops it when the process dies, and
    the worker starts no helper process (no ``caffeinate``) that could outlive it."""
    record = tmp_path / "awake"
    w = worker()
    submit(conn, 4, max_tokens=1800)
    wait_for(lambda: records(record), 120, "the hold", w)
    pid = w.proc.pid
    children = [
        c
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]
    assert children == []
    w.proc.kill()
    assert w.proc.wait(30) == -signal.SIGKILL
    assert [what for what, _ in records(record)] == ["hold"]  # released by the OS, not by us


@pytest.mark.slow
def test_no_keep_awake_records_nothing(worker, conn, tmp_path: Path):
    w = worker("--no-keep-awake")
    batch = submit(conn, 2, max_tokens=50)
    assert batches.wait_for_batch(conn, batch, timeout=120).finished == 2
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(60) == 0
    assert not (tmp_path / "awake").exists()
