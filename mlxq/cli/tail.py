"""``mlxq tail``: follow a streaming job's output as it is generated."""

from __future__ import annotations

import click

from mlxq.broker import keys
from mlxq.broker.rq_store import reads
from mlxq.cli.support import connect, fail, redis_errors, redis_option
from mlxq.wire import json_encoder


@click.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print each stream entry as JSON.")
@redis_option
def tail(job_id: str, as_json: bool, redis_url: str) -> None:
    """Follow a `stream: true` job's output as it is generated, until it ends."""
    from mlxq.broker import streams

    conn = connect(redis_url)
    with redis_errors(redis_url):
        if not reads.job_exists(conn, job_id) and not conn.exists(keys.stream(job_id)):
            fail(f"no job {job_id!r} on this Redis (check the id and --redis-url)")
        reason = None
        for entry in streams.follow(conn, job_id):
            if as_json:
                click.echo(json_encoder.encode(entry).decode())
            else:
                click.echo(entry.text, nl=False)
            reason = entry.finish_reason or reason
    if not as_json:
        click.echo("")
    if reason is None:
        fail(f'job {job_id} ended without streaming (submit it with "stream": true)')
    click.echo(f"[{reason}]", err=True)
