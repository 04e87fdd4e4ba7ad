"""``mlxq dashboard``: a live, read-only web page of batches, workers and queues.

Served like ``mlxq api`` (Starlette + uvicorn, the ``api`` extra, imported only here). On a
loopback address it is open to this machine; on any other address it needs the API keys
``mlxq api`` uses (``MLXQ_API_KEYS``, ``--keys-file``) and refuses to start without them.
"""

from __future__ import annotations

import click

from mlxq.api.auth import ENV_API_KEYS, load_keys
from mlxq.cli.support import check_port_free, connect, log_level_option, redis_option
from mlxq.errors import needs_extra
from mlxq.server import is_loopback


def dashboard_keys(host: str, keys_file: str | None) -> list[str] | None:
    """The keys the JSON endpoint needs: none on loopback, the API keys elsewhere."""
    if is_loopback(host):
        return None
    api_keys = load_keys(keys_file)
    if not api_keys:
        raise click.UsageError(
            f"the dashboard on {host} would show your fleet to the network: set "
            f"{ENV_API_KEYS} (comma-separated) or give --keys-file (one key per line), "
            "or serve it on 127.0.0.1"
        )
    return api_keys


@click.command("dashboard")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8100, show_default=True, type=click.IntRange(0, 65535))
@redis_option
@click.option(
    "--keys-file",
    type=click.Path(exists=True, dir_okay=False),
    help=f"File of API keys, one per line (added to ${ENV_API_KEYS}); needed off loopback.",
)
@click.option(
    "--stuck-after",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    metavar="MINUTES",
    help="Flag a batch with work left when none of its jobs ended for this long.",
)
@log_level_option("warning")
def dashboard(
    host: str,
    port: int,
    redis_url: str,
    keys_file: str | None,
    stuck_after: float,
    log_level: str,
) -> None:
    """Serve a live page of every batch (progress, tok/s, ETA), worker and queue.

    It flags what needs a person: jobs waiting on a queue no live worker serves, batches
    with no job ended for --stuck-after minutes, failed jobs with their commonest reasons.

    \b
    Open http://127.0.0.1:8100/ (read-only; it refreshes itself every 2 s).
    Off loopback, API keys are required: open http://HOST:8100/#key=KEY or type the key in.
    """
    api_keys = dashboard_keys(host, keys_file)
    with needs_extra("api", "mlxq dashboard"):
        import uvicorn
    from mlxq.api.dashboard import create_dashboard_app

    check_port_free(host, port, "--port")
    conn = connect(redis_url)
    app = create_dashboard_app(conn, api_keys, stuck_after_s=stuck_after * 60)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"mlxq dashboard on http://{shown}:{port}/ (Ctrl-C to stop)", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())
