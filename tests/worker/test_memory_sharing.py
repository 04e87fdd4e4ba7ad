"""Two workers on one machine: the second sees the first through Redis
and sizes its memory from what is left, or refuses in one line."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from mlxq.worker.profile import WorkerProfile
from tests.helpers import Worker, run_mlxq


@pytest.fixture
def long_model(tiny_model_dir: Path, tmp_path: Path) -> str:
    """The tiny model with a 16M-token context: its KV budget is limited by memory alone
    (max_batch x context never fits), as a real model's is."""
    folder = tmp_path / "long"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**24}))
    return str(folder)


def _held_gib(log: str) -> float:
    found = re.search(r"this worker holds ([0-9.]+) GiB", log)
    assert found, log
    return float(found.group(1))


def test_a_second_worker_takes_what_the_first_leaves(long_model, valkey_url, conn, tmp_path):
    from mlxq.broker import fleet

    first = Worker(valkey_url, long_model, "--memory-fraction", "0.5", log=tmp_path / "a.log")
    try:
        first.wait_listening(conn)
        (info,) = fleet.live_workers(conn)
        memory = info.memory_bytes
        assert info.memory_claimed_bytes == pytest.approx(0.5 * memory, rel=0.01)
        second = run_mlxq("worker", "--model", long_model, "--burst", url=valkey_url)
    finally:
        first.stop()
    assert second.returncode == 0, second.stderr
    # 75% of the memory for all workers on it, half of it held by the first
    assert _held_gib(second.stderr) == pytest.approx(0.25 * memory / 2**30, abs=0.1)
    assert f"1 live worker(s) on this host's memory ({info.name} (pid {info.pid})" in second.stderr


def test_a_worker_with_no_memory_left_refuses_in_one_line(long_model, valkey_url, conn, tmp_path):
    first = Worker(valkey_url, long_model, log=tmp_path / "a.log")
    try:
        first.wait_listening(conn)
        second = run_mlxq("worker", "--model", long_model, "--burst", url=valkey_url)
    finally:
        first.stop()
    assert second.returncode == 1
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxq: error: not enough memory left for this worker: 1 live worker")
    assert "--memory-fraction" in last and "Traceback" not in second.stderr


def test_small_workers_share_a_machine_and_a_dead_ones_record_is_ignored(
    tiny_model, conn: redis.Redis
):
    """Workers whose batch x context is small hold only that; a record whose process is
    gone (a crashed worker, until it expires) holds nothing."""
    from mlxq.engine.hardware import DeviceFacts
    from mlxq.wire import ModelInfo, WorkerInfo
    from mlxq.worker.config import resolve
    from mlxq.worker.sharing import neighbours

    facts = DeviceFacts("metal", "dev", 16 * 2**30, 16 * 2**30, "host", "os")
    info = ModelInfo("m", "llama", 16, 2048, 8, 64, 1000, 8192, 2**15, 2**30, "f16")
    small = resolve(WorkerProfile(model="m", max_batch=4), facts, info)
    assert small.kv_budget_bytes == 4 * 8192 * 2**15  # 1 GiB, not 11
    whole = resolve(WorkerProfile(model="m"), facts, info)

    def record(name: str, pid: int, held: int, domain: str = "system") -> WorkerInfo:
        import socket

        return WorkerInfo(
            name, socket.gethostname(), pid, "m", ["q"], "metal", "dev", 16 * 2**30, 4, 0, 0,
            0, 0, 0, 0, 0.0, 0.0, 0.0, memory_claimed_bytes=held, memory_domain=domain,
        )  # fmt: skip

    beside_small = resolve(
        WorkerProfile(model="m"), facts, info, [record("a", 1, small.claimed_bytes)]
    )
    assert beside_small.claimed_bytes == pytest.approx(12 * 2**30 - small.claimed_bytes, abs=2)
    other_gpu = resolve(
        WorkerProfile(model="m"), facts, info, [record("b", 1, 12 * 2**30, "cuda:1")]
    )
    assert other_gpu.kv_budget_bytes == whole.kv_budget_bytes

    from mlxq.broker import fleet

    ended = subprocess.Popen(["true"])  # a pid that no longer runs
    ended.wait()
    fleet.publish(conn, record("gone", ended.pid, 12 * 2**30), ttl=30)
    fleet.publish(conn, record("alive", 1, 12 * 2**30), ttl=30)  # init: always running
    assert [w.name for w in neighbours(conn)] == ["alive"]


def test_two_workers_started_at_the_same_moment_share_the_memory(
    long_model, valkey_url, conn, tmp_path
):
    """Each claims its share before its model loads, so neither takes what the other
    claimed: together they stay within the machine's 75 %, whatever the timing."""
    from mlxq.broker import fleet

    args = ("--memory-fraction", "0.4")
    both = [Worker(valkey_url, long_model, *args, log=tmp_path / f"{i}.log") for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while len(fleet.live_workers(conn)) < 2:
            assert all(w.proc.poll() is None for w in both), [w.log.read_text() for w in both]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        infos = fleet.live_workers(conn)
    finally:
        logs = [w.stop() for w in both]
    memory = infos[0].memory_bytes
    held = sorted(w.memory_claimed_bytes for w in infos)
    assert sum(held) <= 0.75 * memory * 1.01, (held, memory)
    assert held[1] == pytest.approx(0.4 * memory, rel=0.01)  # the first to claim: its own
    assert held[0] == pytest.approx(0.35 * memory, rel=0.01)  # the other: what is left
    assert any("starting)" in log or "live worker(s) on this host's memory" in log for log in logs)


def test_an_exited_worker_s_claim_holds_nothing_and_a_clean_exit_drops_it(
    long_model, valkey_url, conn, tmp_path
):
    """A worker that exited and that its parent has not reaped yet (a zombie: a burst
    worker done before its sibling, under a test or a supervisor) holds no memory and is
    waited for by no starting worker; a worker that exits cleanly drops its claim."""
    import msgspec

    from mlxq.broker import keys
    from mlxq.worker import sharing

    host = keys.starting_workers(socket.gethostname())
    exited = subprocess.Popen(["true"])  # not waited for: a zombie once it ends
    alive = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{exited.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not end"
            time.sleep(0.05)
        for proc in (exited, alive):  # both still loading (no bytes claimed) and first in line
            claim = sharing.Starting(f"pid{proc.pid}", proc.pid, 0.5)
            conn.hset(host, mapping={str(proc.pid): msgspec.json.encode(claim), f"t:{proc.pid}": 0})
        claims = sharing.claim_start(conn, "me", 0.5, wait_s=0.5)
        assert [c.pid for c in claims] == [alive.pid]
    finally:
        alive.kill()
        alive.wait()
        exited.wait()
    conn.delete(host)
    worker = Worker(valkey_url, long_model, "--memory-fraction", "0.3", log=tmp_path / "w.log")
    worker.wait_listening(conn)
    assert str(worker.proc.pid).encode() in conn.hkeys(host)
    worker.stop()
    assert worker.proc.returncode == 0
    assert str(worker.proc.pid).encode() not in conn.hkeys(host)


def test_a_worker_counts_no_claim_made_after_its_own_that_still_loads(conn):
    """Of workers started together, the one with the first claim counts none of the later
    ones still loading (they wait for it, then size themselves from what it holds: counted
    whole, they left it nothing, and it refused to start); a later one that has loaded
    (it gave up waiting) counts what it holds; an earlier one still loading, its fraction."""
    import msgspec

    from mlxq.broker import keys
    from mlxq.worker import sharing

    host = keys.starting_workers(socket.gethostname())
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        later, loaded, earlier = procs
        conn.hset(host, "#", 10)  # (this process's claim takes ticket 11)
        for proc, ticket, held in ((later, 12, 0), (loaded, 13, 5 << 30), (earlier, 3, 0)):
            claim = sharing.Starting(f"pid{proc.pid}", proc.pid, 0.5, claimed_bytes=held)
            conn.hset(
                host, mapping={str(proc.pid): msgspec.json.encode(claim), f"t:{proc.pid}": ticket}
            )
        claims = sharing.claim_start(conn, "me", 0.5, wait_s=0.5)
        assert sorted(c.pid for c in claims) == sorted([loaded.pid, earlier.pid])
        conn.hdel(host, str(earlier.pid))
        assert [c.pid for c in sharing.claim_start(conn, "me", 0.5, wait_s=0)] == [loaded.pid]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
