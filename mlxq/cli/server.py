"""``mlxq server``: a persistent embedded Valkey for local workers and submitters."""

from __future__ import annotations

import time
from pathlib import Path

import click

from mlxq.cli.support import check_port_free, fail


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
    default=Path.home() / ".mlxq" / "valkey",
    show_default=True,
    help="Where the server persists queues and results.",
)
@click.option("--no-persist", is_flag=True, help="Keep everything in memory only.")
@click.option(
    "--password",
    envvar="MLXQ_SERVER_PASSWORD",
    show_envvar=True,
    help="Require this password (AUTH).",
)
def server(port: int, host: str, data_dir: Path, no_persist: bool, password: str | None) -> None:
    """Run a persistent embedded Valkey server for local workers and submitters."""
    from mlxq.server import is_loopback, make_server

    if not is_loopback(host) and not password:
        fail(
            f"refusing to listen on {host} without --password: anyone on the network "
            "could read and write your queues"
        )
    check_port_free(host, port, "--port")
    srv = make_server(
        port=port, host=host, data_dir=data_dir, persist=not no_persist, password=password
    )
    srv.start()
    where = f"redis://{host}:{srv.port}/0"
    click.echo(f"mlxq server listening on {where} (data in {data_dir}); Ctrl-C to stop", err=True)
    try:
        while srv.is_running():
            time.sleep(1)
        fail("the server exited; see its log in " + str(data_dir / "valkey.log"))
    except KeyboardInterrupt:
        click.echo("stopping (saving data)...", err=True)
    finally:
        if srv.is_running():
            srv.stop(timeout=30)
