"""``mlxq api`` closes idle and slow connections and caps how many are open: run as a user
runs it (a subprocess, here under macOS's default limit of 256 descriptors), probed with raw
sockets and the official ``openai`` client."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from helpers import ROOT, free_port, wait_for_port

KEY = "sk-mlxq-conn-test"
CLOSED_WITHIN = 30  # seconds a test waits for a close that is due after --read-timeout


@contextlib.contextmanager
def mlxq_api(valkey_url: str, read_timeout: int, log: Path) -> Iterator[int]:
    """``mlxq api`` with ``--read-timeout`` and ``--keep-alive-timeout`` of
    ``read_timeout`` seconds, at 256 descriptors, its stderr in ``log``: its port."""
    port = free_port()
    timeouts = ["--read-timeout", str(read_timeout), "--keep-alive-timeout", str(read_timeout)]
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxq", "api", "--port", str(port), *timeouts],
            cwd=ROOT,
            env={**os.environ, "MLXQ_REDIS_URL": valkey_url, "MLXQ_API_KEYS": KEY},
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)),
            stderr=err,
        )
    try:
        wait_for_port(port, proc, timeout=60)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def api_port(valkey_url: str, tmp_path: Path) -> Iterator[int]:
    """``mlxq api`` that closes connections after one second of silence."""
    with mlxq_api(valkey_url, 1, tmp_path / "api.log") as port:
        yield port


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=CLOSED_WITHIN)


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` (reads until EOF; a response may come first)."""
    try:
        while chunk := sock.recv(65536):
            del chunk
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_idle_and_slow_connections_are_closed(api_port):
    idle = _connect(api_port)  # connects, sends nothing
    slow_head = _connect(api_port)
    slow_head.sendall(b"GET /v1/models HTTP/1.1\r\n")  # and never the rest of the head
    slow_body = _connect(api_port)
    slow_body.sendall(
        b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        + f"Authorization: Bearer {KEY}\r\n\r\n".encode()
        + b'{"input'  # 7 of 100 bytes, then silence
    )
    kept_alive = _connect(api_port)
    kept_alive.sendall(  # answered, then idle
        f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    )
    for sock in (idle, slow_head, slow_body, kept_alive):
        with sock:
            assert _closed_by_server(sock)


def test_a_head_sent_a_byte_at_a_time_is_cut_off(api_port):
    """Bytes that trickle in do not extend the head's deadline."""
    head = b"GET /v1/models HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 10_000
    with _connect(api_port) as sock:
        started = time.monotonic()
        for i in range(len(head)):
            try:
                sock.sendall(head[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the server took a 10 kB head at 20 bytes a second")
        assert time.monotonic() - started < CLOSED_WITHIN


def test_hundreds_of_idle_connections_do_not_stop_the_server(valkey_url, conn, tmp_path):
    """300 idle connections against 256 descriptors: the ones past the cap are answered
    503 at once, the rest are closed after the read timeout, and a real client is served
    (after retries on 503) without the server ever running out of descriptors."""
    log = tmp_path / "api.log"
    # A read timeout longer than the burst: a burst past the listen backlog waits on SYN
    # retries (seconds), and a held connection closed meanwhile would free its place for
    # a later one, which is then held, not refused.
    with mlxq_api(valkey_url, 25, log) as port:
        socks = [_connect(port) for _ in range(300)]
        try:
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1",
                api_key=KEY,
                max_retries=10,
                timeout=CLOSED_WITHIN,
            )
            assert client.models.list().data == []  # (conn: a flushed server)
            answers = [_read_all(sock) for sock in socks]
        finally:
            for sock in socks:
                sock.close()
    cap = (256 - 64) // 2  # half the descriptors after a reserve: serving.ConnectionLimits
    assert sum(a.startswith(b"HTTP/1.1 503") for a in answers) >= 300 - cap - 16
    assert "Too many open files" not in log.read_text()


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends on ``sock`` until it closes it."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data
