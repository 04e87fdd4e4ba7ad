"""Starting the ranks of ``mlxq worker --hosts A,B[,...]`` (MLX's ring backend).

As ``mlx.launch --backend ring`` does: every host gets an address ``ip:port`` in one
hostfile (``[["ip:port"], ...]``), and rank ``i`` runs the same ``mlxq worker`` command
with ``MLX_RANK=i`` and ``MLX_HOSTFILE`` set, locally or over ``ssh`` (the same Python
path on every host). Before anything starts, every host must resolve and answer ssh; a
host that does not fails the start in one line that names it. Unlike ``mlx.launch`` this
exits with rank 0's status (3 after a stall: the service manager restarts the worker),
hands SIGINT and SIGTERM to rank 0 alone (it winds down and closes the other ranks), and
prefixes the other ranks' output with their rank and host.

``MLXQ_RING_PORT`` sets the first port (rank ``i`` listens on it plus ``i``); by default
32323 (MLX's), or free ports when every host is this machine.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from mlxq.errors import StartupError
from mlxq.worker.profile import WorkerProfile

PORT_ENV = "MLXQ_RING_PORT"
RING_PORT = 32323
SSH = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
# Seconds the other ranks get to exit by themselves after rank 0 has.
FOLLOW_EXIT_S = 10.0


def launch(profile: WorkerProfile) -> int:
    """Start one rank per host of ``profile.hosts`` and wait; rank 0's exit status."""
    if profile.backend != "ring":
        raise StartupError(
            f"--backend {profile.backend}: start the ranks with MLX's launcher and its "
            "hostfile (mlx.launch --backend jaccl --hostfile HOSTS.json -- mlxq worker ...)"
        )
    hosts = profile.hosts
    ips = [address(h) for h in hosts]
    local = [ip.startswith("127.") or ip in own_addresses() for ip in ips]
    for host, here in zip(hosts, local, strict=True):
        if not here:
            check_ssh(host)
    ports = _ports(len(hosts), all(local))
    hostfile = json.dumps([[f"{ip}:{port}"] for ip, port in zip(ips, ports, strict=True)])
    command = [sys.executable, "-m", "mlxq", *sys.argv[1:]]
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="mlxq-ring-") as f:
        f.write(hostfile)
        f.flush()
        ranks = [
            _start(rank, host, here, command, f.name, hostfile)
            for rank, (host, here) in enumerate(zip(hosts, local, strict=True))
        ]
        return _wait(ranks, hosts)


def address(host: str) -> str:
    """The IPv4 address of ``host``, or a :class:`StartupError` naming it."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError as e:
        raise StartupError(
            f"host {host}: unknown host name ({e.strerror or e}): fix --hosts (names or "
            "IP addresses that every host can reach)"
        ) from e


def own_addresses() -> set[str]:
    """This machine's IPv4 addresses (as far as its name resolves)."""
    try:
        return {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        return set()


def check_ssh(host: str) -> None:
    """A :class:`StartupError` naming ``host`` if ``ssh host`` does not answer."""
    try:
        done = subprocess.run(
            [*SSH, host, "true"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise StartupError(f"host {host}: cannot run ssh to it ({e})") from e
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        raise StartupError(
            f"host {host}: unreachable over ssh ({why}): every host must accept "
            "`ssh HOST` without a password (ssh-copy-id)"
        )


def _ports(n: int, all_local: bool) -> list[int]:
    if (given := os.environ.get(PORT_ENV)) is not None:
        return [int(given) + i for i in range(n)]
    if not all_local:
        return [RING_PORT + i for i in range(n)]
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _start(
    rank: int, host: str, here: bool, command: list[str], path: str, hostfile: str
) -> subprocess.Popen[bytes]:
    if here:
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": path}
        args: list[str] = command
    else:
        env = dict(os.environ)
        script = (
            f"cd {shlex.quote(os.getcwd())} 2>/dev/null; f=$(mktemp); "
            f"printf %s {shlex.quote(hostfile)} > $f; "
            f"MLX_RANK={rank} MLX_HOSTFILE=$f exec {shlex.join(command)}"
        )
        args = [*SSH, host, script]
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.PIPE if rank else None,
        stderr=subprocess.STDOUT if rank else None,
        start_new_session=rank > 0,  # (a terminal's Ctrl-C reaches rank 0 only)
    )
    if proc.stdout is not None:
        threading.Thread(
            target=_relay, args=(proc.stdout, f"[rank {rank} {host}] "), daemon=True
        ).start()
    return proc


def _relay(stream: IO[bytes], prefix: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stderr.write(prefix + line.decode(errors="replace"))
        sys.stderr.flush()


def _wait(ranks: list[subprocess.Popen[bytes]], hosts: list[str]) -> int:
    """Rank 0's status (else the first failed rank's), once every rank has exited."""
    first = ranks[0]

    def forward(signum: int, _frame: object) -> None:
        if first.poll() is None:
            first.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    reported: set[int] = set()
    while first.poll() is None:
        for rank, proc in enumerate(ranks[1:], start=1):
            if proc.poll() not in (None, 0) and rank not in reported:
                reported.add(rank)
                sys.stderr.write(
                    f"mlxq: rank {rank} on {hosts[rank]} exited with status {proc.returncode}\n"
                )
        time.sleep(0.2)
    deadline = time.monotonic() + FOLLOW_EXIT_S
    for proc in ranks[1:]:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(FOLLOW_EXIT_S)
            except subprocess.TimeoutExpired:  # (a stopped or hung rank ignores SIGTERM)
                proc.kill()
                proc.wait()
    codes = [p.returncode for p in ranks]
    return codes[0] if codes[0] != 0 else next((c for c in codes if c != 0), 0)
