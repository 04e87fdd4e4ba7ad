"""``mlxq api``: serve OpenAI's Batch API (files, batches, models) on top of mlxq's queues.

The web framework is imported only when the command runs, so the rest of the CLI works
without the ``api`` extra installed.
"""

from __future__ import annotations

import logging

import click

from mlxq.api import serving
from mlxq.api.auth import ENV_ADMIN_KEYS, ENV_API_KEYS, load_key_roles
from mlxq.cli.support import check_port_free, connect, log_level_option, redis_option
from mlxq.server import is_loopback

ENV_ALLOW_UNSERVED = "MLXQ_API_ALLOW_UNSERVED_MODELS"
ENV_MODELS = "MLXQ_API_MODELS"


def resolve_keys(keys_file: str | None, no_auth: bool, host: str) -> dict[str, bool] | None:
    """The API keys to require (each mapped to whether it is an admin key), or None with
    ``--no-auth``; refuses unsafe setups."""
    if no_auth:
        if not is_loopback(host):
            raise click.UsageError(
                f"--no-auth serves without authentication: only on a loopback address "
                f"(127.0.0.1, ::1, localhost), not {host!r}"
            )
        return None
    try:
        roles = load_key_roles(keys_file)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--keys-file") from e
    if not roles:
        raise click.UsageError(
            f"no API keys: set {ENV_API_KEYS} (comma-separated) or give --keys-file (one key "
            "per line); or, on a loopback address only, pass --no-auth explicitly"
        )
    return roles


@click.command("api")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@redis_option
@click.option(
    "--keys-file",
    type=click.Path(exists=True, dir_okay=False),
    help=f"File of API keys, one per line (added to ${ENV_API_KEYS}, comma-separated); "
    f"`KEY admin` makes KEY an admin key (like ${ENV_ADMIN_KEYS}). Each key is a tenant.",
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
@click.option(
    "--allow-unserved-models",
    is_flag=True,
    envvar=ENV_ALLOW_UNSERVED,
    help="Queue batches for models no live worker serves (workers started later run them); "
    f"without it such a batch fails with model_not_found. Env: {ENV_ALLOW_UNSERVED}=1.",
)
@click.option(
    "--models",
    "expected_models",
    multiple=True,
    envvar=ENV_MODELS,
    metavar="MODEL",
    help="Accept batches for MODEL although no worker has served it yet (repeat for "
    "several; models served in the last week are accepted anyway). "
    f"Env: {ENV_MODELS}, space-separated.",
)
@click.option(
    "--read-timeout",
    default=serving.DEFAULT_READ_TIMEOUT,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds a client may take to send a request's head, or stay silent inside a body.",
)
@click.option(
    "--keep-alive-timeout",
    default=serving.DEFAULT_KEEP_ALIVE,
    show_default=True,
    type=click.IntRange(min=1),
    help="Seconds an idle connection is kept open between requests.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    help="Open connections at most; more are answered 503 [default: half the open-file limit].",
)
@log_level_option("info")
def api_command(
    host: str,
    port: int,
    redis_url: str,
    keys_file: str | None,
    no_auth: bool,
    max_upload_bytes: int,
    max_lines: int,
    sweep_interval: float,
    allow_unserved_models: bool,
    expected_models: tuple[str, ...],
    read_timeout: float,
    keep_alive_timeout: int,
    max_connections: int | None,
    log_level: str,
) -> None:
    """Serve OpenAI's Batch API: upload a JSONL file, create a batch, poll, download.

    \b
    Existing OpenAI client code works unchanged but for base_url and api_key:
      OpenAI(base_url="http://HOST:8000/v1", api_key=KEY)
    Requests run on mlxq workers: the queue is the last part of the lines' `model`. A
    batch for a model that workers serve, or served in the last week, waits for them
    (asleep or restarting); one for a model no worker ever served fails
    (model_not_found) unless --models names it or --allow-unserved-models.
    Each key sees only its own files and batches; admin keys see all.
    """
    roles = resolve_keys(keys_file, no_auth, host)
    from mlxq.api.app import ApiSettings, create_app

    check_port_free(host, port, "--port")
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = ApiSettings(
        redis_url=redis_url,
        api_keys=None if roles is None else list(roles),
        admin_keys=[k for k, admin in (roles or {}).items() if admin],
        max_upload_bytes=max_upload_bytes,
        max_lines=max_lines,
        sweep_interval=sweep_interval,
        allow_unserved_models=allow_unserved_models,
        expected_models=list(expected_models),
    )
    conn = connect(redis_url, writes_jobs=True)
    if roles is None:
        click.echo("mlxq api: warning: authentication is off (--no-auth)", err=True)
    app = create_app(settings, conn)
    limits = serving.ConnectionLimits(read_timeout, keep_alive_timeout, max_connections)
    serving.run(app, host, port, limits, log_level.lower())
