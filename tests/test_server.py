"""``mlxq server`` and ``mlxq run``'s embedded Valkey as real processes and signals: Valkey
stops with them (SIGTERM, SIGINT, even SIGKILL), ``--no-persist`` reads and writes no data
folder, and one data folder has one server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from helpers import ROOT, free_port

from mlxq import orphans
from mlxq.server import make_server

GONE_WITHIN = 30  # seconds a test waits for a process that is due to end


def _start_server(*args: str, env: dict | None = None, says: str = "") -> subprocess.Popen:
    """``mlxq server ARGS`` (stderr piped), returned once it says it listens (and ``says``
    in that line)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxq", "server", *args],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert line.startswith("mlxq server listening") and says in line, line + proc.stderr.read()
    return proc


@pytest.fixture
def servers() -> Iterator[list[subprocess.Popen]]:
    """Processes a test starts, killed at its end if still running."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _port_free(port: int) -> bool:
    try:
        redis.Redis(port=port, socket_connect_timeout=1).ping()
    except redis.ConnectionError:
        return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_valkey_stops_with_the_server(tmp_path, servers, sig):
    port = free_port()
    proc = _start_server("--port", str(port), "--data-dir", str(tmp_path / "data"))
    servers.append(proc)
    redis.Redis(port=port).set("kept", "yes")
    (valkey,) = _children(proc.pid)
    proc.send_signal(sig)
    proc.wait(GONE_WITHIN)
    _wait(lambda: not _alive(valkey), f"Valkey outlived mlxq server's {sig.name}")
    assert _port_free(port)
    if sig is not signal.SIGKILL:
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    # What it held was saved: the next server on the folder has it.
    servers.append(_start_server("--port", str(port), "--data-dir", str(tmp_path / "data")))
    assert redis.Redis(port=port).get("kept") == b"yes"


def test_one_data_folder_one_server(tmp_path, servers):
    data = tmp_path / "data"
    first = _start_server("--port", str(free_port()), "--data-dir", str(data))
    servers.append(first)
    second = subprocess.run(
        [sys.executable, "-m", "mlxq", "server", "--port", str(free_port()), "--data-dir", data],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GONE_WITHIN,
    )
    err = second.stderr
    assert second.returncode == 1
    assert err.strip().splitlines() == [
        f"mlxq: error: another mlxq server (pid {first.pid}) uses the data folder {data}; "
        "stop it, or give this one another --data-dir"
    ]
    assert first.poll() is None


def test_no_persist_reads_and_writes_no_data_folder(tmp_path, servers):
    home = tmp_path / "home"
    saved = make_server(data_dir=home / ".mlxq" / "valkey", persist=True)
    saved.start()
    redis.Redis(port=saved.port).set("old", "1")
    saved.stop()  # writes its data where a default `mlxq server` reads it
    before = sorted(p.name for p in (home / ".mlxq" / "valkey").iterdir())

    port = free_port()
    env = {**os.environ, "HOME": str(home)}
    proc = _start_server("--port", str(port), "--no-persist", env=env, says="in memory only")
    servers.append(proc)
    conn = redis.Redis(port=port)
    assert conn.dbsize() == 0
    conn.set("new", "1")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=GONE_WITHIN)
    assert proc.returncode == 0 and err == "stopping...\n", err
    assert sorted(p.name for p in (home / ".mlxq" / "valkey").iterdir()) == before

    both = subprocess.run(
        [sys.executable, "-m", "mlxq", "server", "--no-persist", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GONE_WITHIN,
    )
    assert both.returncode == 1 and "contradict" in both.stderr


def test_a_sigkilled_run_leaves_no_valkey(tmp_path, tiny_model):
    """An OOM kill of ``mlxq run`` (SIGKILL: no handler runs) takes its Valkey with it."""
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "Once upon a time", "max_tokens": 4000}\n' * 64)
    out = str(tmp_path / "out.jsonl")
    data = str(tmp_path / "data")  # not a folder under ~/.mlxq/run
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxq",
            "run",
            str(prompts),
            "--model",
            tiny_model,
            "-o",
            out,
            "--data-dir",
            data,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the batch is submitted: Valkey runs
            if line.startswith("running "):
                break
        valkeys = [pid for pid in _children(proc.pid) if "valkey" in _command(pid)]
        assert len(valkeys) == 1
    finally:
        proc.kill()
        proc.wait()
    _wait(lambda: not _alive(valkeys[0]), "Valkey outlived a SIGKILLed mlxq run")


def _command(pid: int) -> str:
    ps = ["ps", "-o", "command=", "-p", str(pid)]
    return subprocess.run(ps, capture_output=True, text=True).stdout


def test_the_watchdog_stops_the_child_of_a_killed_parent(tmp_path):
    """The fallback where the kernel has no PR_SET_PDEATHSIG (macOS), tried here too: a
    parent that watches a child, SIGKILLed, and a parent that lets the watch go."""
    script = (
        "import subprocess, sys, time\n"
        "from mlxq import orphans\n"
        "child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "dog = orphans.watch(child.pid, always=True)\n"
        "print(child.pid, flush=True)\n"
        "if sys.argv[1] == 'release':\n"
        "    dog.release(); print('released', flush=True)\n"
        "time.sleep(600)\n"
    )
    killed = subprocess.Popen(
        [sys.executable, "-c", script, "wait"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    released = subprocess.Popen(
        [sys.executable, "-c", script, "release"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert killed.stdout is not None and released.stdout is not None
    watched, kept = int(killed.stdout.readline()), int(released.stdout.readline())
    assert released.stdout.readline() == "released\n"
    killed.kill()
    released.kill()
    _wait(lambda: not _alive(watched), "the watched child outlived its parent")
    assert _alive(kept)  # a released watch signals nothing
    os.kill(kept, signal.SIGKILL)
    assert orphans.watch(os.getpid()) is None or not sys.platform.startswith("linux")


def test_a_port_taken_before_valkey_binds_it_is_given_up_for_another(monkeypatch, tmp_path):
    """Another process takes the free port found for the server before Valkey binds it (two
    test sessions, or two `mlxq run`s, starting at once): it starts on another."""
    import socket

    import mlxq.server

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    found = mlxq.server.get_port_or_find_free
    monkeypatch.setattr(
        mlxq.server, "get_port_or_find_free", lambda p, h: next(ports, None) or found(p, h)
    )
    server = mlxq.server.make_server(data_dir=tmp_path)
    server.start()
    try:
        assert server.port != taken.getsockname()[1]
        assert redis.Redis.from_url(server.connection_url).ping()
    finally:
        server.stop()
        taken.close()
