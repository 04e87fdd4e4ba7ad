"""Fleet commands: ``mlxq workers`` and the queue overview of ``mlxq status`` (no batch id).

Kept apart from ``mlxq.cli.main`` so it imports nothing of it (``cli`` registers these).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import click
import redis

from mlxq.broker import fleet, keys
from mlxq.cli.support import age, connect, describe_url, redis_errors, redis_option
from mlxq.wire import WorkerInfo, json_encoder


# -- formatting ------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}G"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


WORKER_HEADERS = (
    "NAME",
    "HOST",
    "MODEL",
    "DEVICE",
    "BATCH",
    "KV USED/BUDGET",
    "IN FLIGHT",
    "DONE",
    "FAILED",
    "TOK/S",
    "BEAT",
)


def worker_row(w: WorkerInfo, now: float) -> list[str]:
    """One table row of a worker (the model as its last path component)."""
    kv = f"{_gib(w.kv_reserved_bytes)}/{_gib(w.kv_budget_bytes)}"
    if w.kv_budget_bytes > 0:
        kv += f" ({100 * w.kv_reserved_bytes / w.kv_budget_bytes:.0f}%)"
    model = keys.queue_name_for_model(w.model) if w.model else "-"
    if w.adapter_path:
        model += "+lora"
    others = [keys.queue_name_for_model(m) for m in w.models if m != w.model]
    if others:  # a worker of several models: the loaded one, then the others
        model += f" (+{', '.join(others)})"
    return [
        f"{w.name} [{w.state}]" if w.state in ("stalled", "paused", "switching") else w.name,
        w.host,
        model,
        f"{w.backend} {w.device} {_gib(w.memory_bytes)}",
        str(w.max_batch),
        kv,
        str(w.in_flight),
        str(w.jobs_done),
        str(w.jobs_failed),
        f"{w.recent_tps:.1f}",
        f"{max(0.0, now - w.heartbeat_at):.0f}s",
    ]


def format_workers(workers: Sequence[WorkerInfo], now: float | None = None) -> str:
    """The ``mlxq workers`` table."""
    now = time.time() if now is None else now
    rows = [worker_row(w, now) for w in workers]
    return _table(WORKER_HEADERS, rows, right={4, 6, 7, 8, 9, 10})


QUEUE_HEADERS = ("QUEUE", "QUEUED", "RUNNING", "FINISHED", "FAILED", "OLDEST", "WORKERS")


def format_queues(queues: Sequence[fleet.QueueInfo]) -> str:
    """The queue overview table (``OLDEST`` is how long the longest-waiting job has waited)."""
    rows = [
        [
            qi.name,
            str(qi.queued),
            str(qi.started),
            str(qi.finished),
            str(qi.failed),
            age(qi.oldest_age_s),
            str(qi.workers),
        ]
        for qi in queues
    ]
    return _table(QUEUE_HEADERS, rows, right={1, 2, 3, 4, 5, 6})


# -- commands --------------------------------------------------------------------------
def print_queue_overview(conn: redis.Redis, as_json: bool) -> None:
    """Every queue's depth, running, finished and failed counts and oldest job's wait.

    ``--json`` prints a list of ``QueueInfo`` objects. Reads only (it answers on a full
    Redis); the caller turns a Redis error into one line (``support.redis_errors``).
    """
    queues = fleet.queue_overview(conn)
    if as_json:
        click.echo(json_encoder.encode(queues).decode())
    elif not queues:
        click.echo("no queues yet (nothing has been submitted to this Redis)")
    else:
        click.echo(format_queues(queues))


@click.command("workers")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of worker records.")
@redis_option
def workers(as_json: bool, redis_url: str) -> None:
    """Live workers: model, device, batch and KV use, jobs, recent tokens/s, heartbeat age.

    A worker shows up while its heartbeat is fresh; one that died drops out within a
    heartbeat interval or so. --json prints the records workers publish (WorkerInfo).
    """
    conn = connect(redis_url)
    with redis_errors(redis_url):
        live = fleet.live_workers(conn)
    if as_json:
        click.echo(json_encoder.encode(live).decode())
    elif not live:
        click.echo(f"no live workers on {describe_url(redis_url)}")
    else:
        click.echo(format_workers(live))
