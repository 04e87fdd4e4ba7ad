"""``mlxq api``: serve OpenAI's Batch API (files, batches, models) on top of mlxq's queues.

The web framework is imported only when the command runs, so the rest of the CLI works
without the ``api`` extra installed.
"""

from __future__ import annotations

import ipaddress
import logging
import sys

import click
import redis

from mlxq.api.auth import ENV_API_KEYS, load_keys
from mlxq.broker import batches as q
from mlxq.broker import keys
from mlxq.cli.support import check_port_free, redis_option
from mlxq.errors import needs_extra


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_keys(keys_file: str | None, no_auth: bool, host: str) -> list[str] | None:
    """The API keys to require, or None with ``--no-auth``; refuses unsafe setups."""
    if no_auth:
        if not is_loopback(host):
            raise click.UsageError(
                f"--no-auth serves without authentication: only on a loopback address "
                f"(127.0.0.1, ::1, localhost), not {host!r}"
            )
        return None
    api_keys = load_keys(keys_file)
    if not api_keys:
        raise click.UsageError(
            f"no API keys: set {ENV_API_KEYS} (comma-separated) or give --keys-file (one key "
            "per line); or, on a loopback address only, pass --no-auth explicitly"
        )
    return api_keys


@click.command("api")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@redis_option
@click.option(
    "--keys-file",
    type=click.Path(exists=True, dir_okay=False),
    help=f"File of API keys, one per line (added to ${ENV_API_KEYS}, comma-separated).",
)
@click.option("--no-auth", is_flag=True, help="Serve without API keys (loopback addresses only).")
@click.option(
    "--max-upload-bytes",
    default=200 * 1024 * 1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Largest file accepted by POST /v1/files (stored in Redis).",
)
@click.option(
    "--max-lines",
    default=50_000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most requests in one batch input file.",
)
@click.option(
    "--sweep-interval",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds between background refreshes of active batches (finalize, expire); 0: off.",
)
@click.option("--log-level", default="info", show_default=True)
def api_command(
    host: str,
    port: int,
    redis_url: str,
    keys_file: str | None,
    no_auth: bool,
    max_upload_bytes: int,
    max_lines: int,
    sweep_interval: float,
    log_level: str,
) -> None:
    """Serve OpenAI's Batch API: upload a JSONL file, create a batch, poll, download.

    \b
    Existing OpenAI client code works unchanged but for base_url and api_key:
      OpenAI(base_url="http://HOST:8000/v1", api_key=KEY)
    Requests run on mlxq workers: the queue is the last part of the lines' `model`.
    """
    api_keys = resolve_keys(keys_file, no_auth, host)
    with needs_extra("api", "mlxq api"):
        import uvicorn
    from mlxq.api.app import ApiSettings, create_app

    check_port_free(host, port, "--port")
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = ApiSettings(
        redis_url=redis_url,
        api_keys=api_keys,
        max_upload_bytes=max_upload_bytes,
        max_lines=max_lines,
        sweep_interval=sweep_interval,
    )
    conn = _connect(redis_url)
    if api_keys is None:
        click.echo("mlxq api: warning: authentication is off (--no-auth)", err=True)
    app = create_app(settings, conn)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())


def _connect(url: str) -> redis.Redis:
    """A client for ``url``, or exit with a message if the server cannot be reached."""
    conn = q.connect(url)
    try:
        conn.ping()
    except redis.RedisError as e:
        click.echo(
            f"mlxq: error: cannot reach Redis ({e}); start one with `mlxq server`, "
            f"or set --redis-url / {keys.ENV_REDIS_URL}",
            err=True,
        )
        sys.exit(1)
    return conn
