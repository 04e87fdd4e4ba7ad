"""``mlxq status``: a batch's counts (and its jobs that nothing holds), or every queue.

Read-only, and cheap whatever the batch's size: counters, a bounded check for unaccounted
jobs (``mlxq.broker.unaccounted.survey``), no transaction and no write, so it answers on a
Redis that is full and refuses writes."""

from __future__ import annotations

import click
import msgspec

from mlxq.broker import batches, unaccounted
from mlxq.cli.fleet import print_queue_overview
from mlxq.cli.support import connect, fail, redis_errors, redis_option
from mlxq.wire import BatchStatus, json_encoder


@click.command()
@click.argument("batch_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@redis_option
def status(batch_id: str | None, as_json: bool, redis_url: str) -> None:
    """Counts of a batch's jobs: total, queued, started, finished, failed.

    Without BATCH_ID: every queue with its depth and the oldest job's age.
    """
    conn = connect(redis_url)
    with redis_errors(redis_url):
        if batch_id is None:
            print_queue_overview(conn, as_json)
            return
        try:
            s = batches.batch_status(conn, batch_id)
        except batches.BatchNotFound as e:
            fail(str(e))
        lost = unaccounted.survey(conn, batch_id)
        if as_json:
            out = msgspec.to_builtins(s)
            if lost.count:
                out.update(
                    unaccounted=lost.ids,
                    unaccounted_count=lost.count,
                    unaccounted_exact=lost.exact,
                )
            click.echo(json_encoder.encode(out).decode())
            return
        _print_status(s)
        if lost.count:
            click.echo(_lost_line(batch_id, lost))
        if s.state != "submitted":
            click.echo(_incomplete(s, batches.get_batch(conn, batch_id).source))


def _print_status(s: BatchStatus) -> None:
    click.echo(
        f"batch {s.batch_id}: {s.done}/{s.total} done — {s.queued} queued, {s.started} "
        f"running, {s.finished} finished, {s.failed} failed, {s.cancelled} cancelled; "
        f"priority {s.priority}"
    )
    if len(s.models) > 1:  # a batch mixing models: each one's progress
        for m in s.models:
            c = m.counts
            click.echo(
                f"  {', '.join(m.models)} (queue {m.queue}): {m.done}/{m.total} done — "
                f"{c['queued']} queued, {c['started']} running, {c['finished']} finished, "
                f"{c['failed'] + c['expired']} failed, {c['cancelled']} cancelled"
            )


def _lost_line(batch_id: str, lost: unaccounted.Unaccounted) -> str:
    """What to say of the batch's jobs that nothing holds."""
    if lost.exact and len(lost.ids) == lost.count:
        ids = "see `mlxq status --json` for their ids"
    else:
        ids = (
            f"`mlxq status --json` lists {len(lost.ids)} of them (status reads at most the "
            f"first {unaccounted.SCAN_LIMIT:,} jobs one by one and lists at most "
            f"{unaccounted.LIST_LIMIT})"
        )
    return (
        f"batch {batch_id}: {'' if lost.exact else 'at least '}{lost.count} jobs wait or run "
        "by their status but no queue or registry holds them; a worker's sweep puts them "
        f"back on their queue after --abandon-after seconds ({ids})"
    )


def _incomplete(s: BatchStatus, source: str | None) -> str:
    """What to say of a batch not fully enqueued."""
    head = f"batch {s.batch_id}: only {s.enqueued} of {s.total} requests were enqueued"
    if s.state == "cancelled":
        if s.enqueued >= s.total:
            return f"batch {s.batch_id}: cancelled"
        return f"{head}; it was cancelled while being submitted"
    if s.submitter_alive:
        return f"batch {s.batch_id}: still being submitted ({s.enqueued} of {s.total} enqueued)"
    return (
        f"{head}: its submit stopped; finish it with `mlxq submit {source or 'FILE'} "
        f"--resume {s.batch_id}`, or remove it with `mlxq cancel {s.batch_id}`"
    )
