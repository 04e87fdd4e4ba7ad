"""Commands that change a batch's jobs: ``mlxq cancel`` and ``mlxq retry``."""

from __future__ import annotations

import click
import redis

from mlxq.broker import batches
from mlxq.broker.rq_store import reads
from mlxq.cli.support import connect, fail, redis_option
from mlxq.wire import json_encoder


def _is_batch(conn: redis.Redis, target: str) -> bool:
    """Whether ``target`` is a batch id (else a job id), or exit saying it is neither."""
    try:
        batches.get_batch(conn, target)
        return True
    except batches.BatchNotFound:
        if reads.job_exists(conn, target):
            return False
    fail(f"no batch or job {target!r} on this Redis (check the id and --redis-url)")


def _job_ids(conn: redis.Redis, target: str) -> list[str]:
    """The job ids of a batch, or the one job id given."""
    return batches.batch_job_ids(conn, target) if _is_batch(conn, target) else [target]


@click.command()
@click.argument("target", metavar="BATCH|JOB")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@redis_option
def cancel(target: str, as_json: bool, redis_url: str) -> None:
    """Cancel a batch or one job: queued jobs are removed, running ones stop at the next
    step (their results say cancelled). Finished jobs are left alone. A batch is marked
    cancelled first, in one step: no worker starts one of its jobs after it."""
    conn = connect(redis_url)
    if _is_batch(conn, target):
        dequeued, flagged = batches.cancel_batch(conn, target)
    else:
        dequeued, flagged = batches.cancel_jobs(conn, [target])
    if as_json:
        click.echo(json_encoder.encode({"removed": dequeued, "stopping": flagged}).decode())
    else:
        click.echo(f"{target}: removed {dequeued} queued jobs, stopping {flagged} running jobs")


@click.command()
@click.argument("target", metavar="BATCH|JOB")
@click.option("--json", "as_json", is_flag=True, help="Print the count as JSON.")
@redis_option
def retry(target: str, as_json: bool, redis_url: str) -> None:
    """Put the failed jobs of a batch (or one failed job) back on their queue."""
    conn = connect(redis_url)
    count = batches.retry_failed(conn, _job_ids(conn, target))
    if as_json:
        click.echo(json_encoder.encode({"requeued": count}).decode())
    else:
        click.echo(f"{target}: re-queued {count} failed jobs")
