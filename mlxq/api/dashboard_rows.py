"""How a batch, a worker and a queue become rows of ``mlxq dashboard``'s page, with the
tokens/s the page estimates for them (see :mod:`mlxq.api.dashboard_state` for what is
measured and what is estimated). Plain functions of the broker's records: no Redis, no state.
"""

from __future__ import annotations

import msgspec

from mlxq.api import dashboard_health as health
from mlxq.broker import keys
from mlxq.broker.failures import FailureSummary
from mlxq.wire import BatchInfo, BatchStatus, ModelProgress, QueueInfo, WorkerInfo

# A worker publishes every ~2 s; one silent for this long is stuck in a step or wedged.
STALL_AFTER_S = 10.0


class BatchRow(msgspec.Struct):
    batch_id: str  # the id its submitter knows: an API batch's ``batch_…``, else mlxq's
    mlxq_batch_id: str  # mlxq's own id (``mlxq status``, ``mlxq cancel``)
    queue: str
    model: str | None
    source: str | None
    state: str  # queued, running, done (none failed), failed (ended, some failed)
    total: int
    queued: int
    started: int
    finished: int
    failed: int
    cancelled: int
    done: int
    tokens_per_s: float | None
    eta_s: float | None
    age_s: float
    tokens_per_s_basis: str | None = None  # how tokens_per_s is estimated, or why it is not
    eta_basis: str | None = None  # the pace eta_s assumes, or why there is none
    flags: list[str] = []  # what is wrong with it, in words (health.batch_flags)
    failures: FailureSummary | None = None  # why its failed jobs failed
    models: list[ModelProgress] = []  # each model's counts, for a batch that mixes models


class ModelName(msgspec.Struct):
    """A model as the page names it: its short name (its queue's, ``queue_name_for_model``)
    and where it comes from (a path or a Hugging Face repo)."""

    name: str
    source: str
    loaded: bool  # the one in memory now (of a worker of several models)


class WorkerRow(msgspec.Struct):
    name: str
    host: str
    model: str  # the loaded model's short name (+lora with an adapter)
    models: list[ModelName]  # every model it serves, the loaded one first
    device: str
    queues: list[str]
    in_flight: int  # jobs it holds: decoding, or prefetched and waiting for a slot
    in_batch: int  # of those, at most this many decode (its batch holds max_batch)
    waiting: int  # the rest, prefetched so a freed slot is filled at once
    max_batch: int
    kv_used: float | None  # reserved / budget of its KV cache, 0..1
    # Its recent_tps; None while it holds jobs none of which ended in the last minute.
    tokens_per_s: float | None
    tokens_per_s_basis: str
    jobs_done: int
    jobs_failed: int
    heartbeat_age_s: float
    stalled: bool


class QueueRow(msgspec.Struct):
    name: str
    depth: int
    running: int
    workers: int  # live workers serving it (stalled ones not counted)
    oldest_age_s: float | None
    flag: str | None = None


def running_by_queue(info: BatchInfo, s: BatchStatus) -> dict[str, int]:
    """The batch's running jobs on each queue it runs on."""
    if s.models:
        return {m.queue: m.counts.get("started", 0) for m in s.models if m.counts.get("started")}
    return {info.queue: s.started} if s.started else {}


def queue_rates(live: list[WorkerInfo], running: dict[str, int]) -> dict[str, float]:
    """The live workers' tokens/s by queue. A worker's rate goes to its loaded model's
    queue when it serves several models; otherwise it is split evenly among its queues
    with jobs running (all of them when none has)."""
    out: dict[str, float] = {}
    for w in live:
        if w.recent_tps <= 0:
            continue
        names = list(dict.fromkeys(w.queues))
        loaded = keys.queue_name_for_model(w.model)
        if w.models and loaded in names:
            names = [loaded]
        else:
            names = [n for n in names if running.get(n)] or names
        for n in names:
            out[n] = out.get(n, 0.0) + w.recent_tps / len(names)
    return out


def batch_tps(
    mine: dict[str, int],
    running: dict[str, int],
    rates: dict[str, float],
    live: list[WorkerInfo],
) -> tuple[float | None, str | None]:
    """A batch's estimated tokens/s: on each queue it has jobs running on, its share of
    that queue's running jobs times the queue's workers' rate; and how that was reached.
    None (with the reason) while it runs nothing, or while its queues' workers finished no
    job in the last minute (their rate is not measured yet)."""
    if not mine:
        return None, None
    tps, parts = 0.0, []
    for name, n in mine.items():
        rate, total = rates.get(name, 0.0), max(running.get(name, 0), n)
        tps += rate * n / total
        parts.append(f"{n} of the {total} jobs running on queue {name} ({rate:.1f} tok/s)")
    if tps > 0:
        return tps, "estimated: its share of its queue's workers' tok/s: " + "; ".join(parts)
    if not any(set(mine) & set(w.queues) for w in live):
        return None, "no live worker serves its queue"
    return None, "its queue's workers ended no job in the last minute (tokens count as jobs end)"


def fleet_tps(workers: list[WorkerInfo], now: float) -> float:
    """The live, not stalled, workers' tokens/s together (what each publishes)."""
    return sum(w.recent_tps for w in workers if not _stalled(w, now))


def _stalled(w: WorkerInfo, now: float) -> bool:
    return w.state == "stalled" or max(0.0, now - w.heartbeat_at) > STALL_AFTER_S


def model_names(w: WorkerInfo) -> list[ModelName]:
    """Every model the worker serves by its short name, the loaded one first."""
    sources = list(dict.fromkeys([w.model, *w.models]))
    return [ModelName(keys.queue_name_for_model(m), m, m == w.model) for m in sources if m]


def batch_row(
    info: BatchInfo, s: BatchStatus, now: float, tps: float | None, eta: float | None
) -> BatchRow:
    """One batch as the page shows it."""
    if s.done >= s.total:
        state = "failed" if s.failed else "done"
    elif s.started or s.done:
        state = "running"
    else:
        state = "queued"
    return BatchRow(
        batch_id=info.batch_id,
        mlxq_batch_id=info.batch_id,
        queue=info.queue,
        model=info.model,
        source=info.source,
        state=state,
        total=s.total,
        queued=s.queued,
        started=s.started,
        finished=s.finished,
        failed=s.failed,
        cancelled=s.cancelled,
        done=s.done,
        tokens_per_s=tps,
        eta_s=eta,
        age_s=max(0.0, now - info.created_at),
        models=s.models if len(s.models) > 1 else [],
    )


def worker_row(w: WorkerInfo, now: float) -> WorkerRow:
    """One worker as the page shows it; ``stalled`` is the worker's own ``state`` when it
    says so, or a heartbeat older than ``STALL_AFTER_S``.

    ``in_flight`` counts the jobs the worker holds, which is up to its batch plus a few
    prefetched ones: the rows it decodes (``decoding``, where the worker says) are in use,
    the rest wait, so the page never shows more in use than the batch.
    """
    age = max(0.0, now - w.heartbeat_at)
    in_batch = min(w.in_flight if w.decoding is None else w.decoding, w.max_batch)
    tps: float | None = w.recent_tps
    basis = "tokens of the jobs it finished over the last minute, per second"
    if w.in_flight and w.recent_tps <= 0:
        tps = None
        basis = (
            f"holds {w.in_flight} jobs, none of which ended in the last minute "
            "(tokens count as jobs end)"
        )
    elif not w.in_flight and w.recent_tps <= 0:
        basis = "idle: it holds no job"
    short = keys.queue_name_for_model(w.model) if w.model else "-"
    return WorkerRow(
        name=w.name,
        host=w.host,
        model=short + (" +lora" if w.adapter_path else ""),
        models=model_names(w),
        device=f"{w.backend} {w.device}",
        queues=list(w.queues),
        in_flight=w.in_flight,
        in_batch=in_batch,
        waiting=max(0, w.in_flight - in_batch),
        max_batch=w.max_batch,
        kv_used=w.kv_reserved_bytes / w.kv_budget_bytes if w.kv_budget_bytes > 0 else None,
        tokens_per_s=tps,
        tokens_per_s_basis=basis,
        jobs_done=w.jobs_done,
        jobs_failed=w.jobs_failed,
        heartbeat_age_s=age,
        stalled=_stalled(w, now),
    )


def queue_row(qi: QueueInfo, served: dict[str, tuple[int, int]]) -> QueueRow:
    """One queue as the page shows it, flagged when jobs wait and no live worker serves it."""
    live, stalled = served.get(qi.name, (0, 0))
    flag = health.unserved(qi.name, live, stalled) if qi.queued and not live else None
    return QueueRow(qi.name, qi.queued, qi.started, live, qi.oldest_age_s, flag)
