"""What ``mlxq dashboard`` shows: one read-only snapshot of batches, workers and queues.

Everything comes from the broker's readers (``batch_status``, ``live_workers``,
``queue_overview``, ``failure_reasons``); nothing here writes to Redis. A batch's tokens/s
is an estimate: the recent tokens/s of the live workers on its queue, shared among that
queue's batches that have jobs running (workers publish their rate, not a per-batch one).
Its ETA comes from how fast its jobs got done over the last couple of minutes, and "no
progress for ..." from when this process last saw one of its jobs end (or, for a batch
none of whose jobs ended yet, from its submit). No web framework here, so the snapshot is
usable (and testable) without the ``api`` extra.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import redis

from mlxq.api import dashboard_health as health
from mlxq.api.dashboard_history import Throughput, TokenHistory
from mlxq.broker import batches as q
from mlxq.broker import fleet, keys
from mlxq.broker.failures import FailureSummary, failure_reasons
from mlxq.wire import BatchInfo, BatchStatus, ModelProgress, QueueInfo, WorkerInfo

MAX_BATCHES = 50  # the most recent batches shown
RATE_WINDOW_S = 120.0  # how far back the ETA's rate looks
DONE_RECHECK_S = 30.0  # a finished batch is re-read this often (a retry can reopen it)
FAILURES_RECHECK_S = 15.0  # failure reasons are re-read at most this often per batch
# A worker publishes every ~2 s; one silent for this long is stuck in a step or wedged.
STALL_AFTER_S = 10.0
# Open pages share a snapshot this young: ten tabs cost Redis what one does.
SHARE_S = 1.0


class BatchRow(msgspec.Struct):
    batch_id: str
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
    flags: list[str] = []  # what is wrong with it, in words (health.batch_flags)
    failures: FailureSummary | None = None  # why its failed jobs failed
    models: list[ModelProgress] = []  # each model's counts, for a batch that mixes models


class WorkerRow(msgspec.Struct):
    name: str
    host: str
    model: str
    device: str
    queues: list[str]
    in_flight: int  # jobs it holds: decoding, or prefetched and waiting for a slot
    in_batch: int  # of those, at most this many decode (its batch holds max_batch)
    waiting: int  # the rest, prefetched so a freed slot is filled at once
    max_batch: int
    kv_used: float | None  # reserved / budget of its KV cache, 0..1
    tokens_per_s: float
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


class Snapshot(msgspec.Struct):
    now: float
    batches: list[BatchRow]
    workers: list[WorkerRow]
    queues: list[QueueRow]
    alerts: list[str] = []  # every flag above, one line each, for the top of the page
    throughput: Throughput | None = None


@dataclass
class _Seen:
    """What this process remembers of one batch between snapshots."""

    info: BatchInfo
    samples: deque[tuple[float, int]] = field(default_factory=deque)
    status: BatchStatus | None = None
    read_at: float = 0.0
    last_done: int | None = None
    progress_at: float = 0.0  # wall time a job of it was last seen ending
    failures: FailureSummary | None = None
    failures_at: float = float("-inf")


class Dashboard:
    """Takes snapshots; remembers batch progress and the fleet's tokens over time.
    Thread-safe. ``clock`` is monotonic (rates, ETAs); ``wall`` is Unix time (ages)."""

    def __init__(
        self,
        conn: redis.Redis,
        clock: Callable[[], float] = time.monotonic,
        *,
        wall: Callable[[], float] = time.time,
        stuck_after_s: float = health.STUCK_AFTER_S,
    ) -> None:
        self.conn = conn
        self._clock, self._wall = clock, wall
        self.stuck_after_s = stuck_after_s
        self.history = TokenHistory()
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()
        self._last: tuple[float, Snapshot] | None = None

    def snapshot(self) -> Snapshot:
        """Every recent batch, live worker and queue, as the page shows them."""
        with self._lock:
            tick = self._clock()
            if self._last is not None and tick - self._last[0] < SHARE_S:
                return self._last[1]
            snap = self._take(tick)
            self._last = (tick, snap)
            return snap

    def sample(self) -> None:
        """Feed the tokens/s history (called every couple of seconds, page open or not)."""
        with self._lock:  # one sample at a time, so each worker's count only moves forward
            self.history.sample(fleet.live_workers(self.conn), self._clock())

    def _take(self, tick: float) -> Snapshot:
        now = self._wall()
        workers = fleet.live_workers(self.conn)
        self.history.sample(workers, tick)
        rows = [worker_row(w, now) for w in workers]
        served = health.serving(workers, {r.name for r in rows if r.stalled})
        queues = [queue_row(qi, served) for qi in fleet.queue_overview(self.conn, now=now)]
        batches = self._batches(now, tick, workers, served)
        alerts = [qr.flag for qr in queues if qr.flag]
        alerts += [f"worker {r.name} stalled" for r in rows if r.stalled]
        for b in batches:
            alerts += [f"batch {b.batch_id}: {f}" for f in b.flags if not f.startswith("no worker")]
            if b.state == "failed":
                alerts.append(f"batch {b.batch_id}: {b.failed} of {b.total} failed")
        return Snapshot(
            now=now,
            batches=batches,
            workers=rows,
            queues=queues,
            alerts=alerts,
            throughput=self.history.series(
                tick, [w for w, r in zip(workers, rows, strict=True) if not r.stalled]
            ),
        )

    def _batches(
        self, now: float, tick: float, workers: list[WorkerInfo], served: dict
    ) -> list[BatchRow]:
        seen = []
        for batch_id in self._recent_ids():
            entry = self._status(batch_id, tick, now)
            if entry is not None:
                seen.append(entry)
        self._seen = {e.info.batch_id: e for e in seen}
        running: dict[str, int] = {}
        for e in seen:
            if e.status and e.status.started:
                running[e.info.queue] = running.get(e.info.queue, 0) + 1
        queue_tps: dict[str, float] = {}
        for w in workers:
            for name in set(w.queues):
                queue_tps[name] = queue_tps.get(name, 0.0) + w.recent_tps
        rows = []
        for e in seen:
            share = running.get(e.info.queue, 0)
            tps = queue_tps.get(e.info.queue, 0.0) / share if share and e.status.started else None
            row = batch_row(e.info, e.status, now, tps, _eta(e, tick))
            row.flags = health.batch_flags(
                e.info, e.status, now - e.progress_at, self.stuck_after_s, served
            )
            row.failures = self._failures(e, tick)
            rows.append(row)
        return rows

    def _recent_ids(self) -> list[str]:
        return [b.decode() for b in self.conn.zrevrange(keys.batches(), 0, MAX_BATCHES - 1)]

    def _status(self, batch_id: str, tick: float, now: float) -> _Seen | None:
        entry = self._seen.get(batch_id)
        try:
            if entry is None:
                entry = _Seen(q.get_batch(self.conn, batch_id))
            s = entry.status
            finished = s is not None and s.done >= s.total
            if not finished or tick - entry.read_at >= DONE_RECHECK_S:
                entry.status = q.batch_status(self.conn, batch_id)
                entry.read_at = tick
        except q.BatchNotFound:
            return None  # expired: its id lingers in the index until then
        done = entry.status.done
        if entry.last_done is None:
            # First sight: with none ended it has not moved since its submit; otherwise
            # its last move is unknown, so the quiet time counts from now (a lower bound).
            entry.progress_at = entry.info.created_at if done == 0 else now
        elif done != entry.last_done:
            entry.progress_at = now
        entry.last_done = done
        entry.samples.append((tick, done))
        while entry.samples and entry.samples[0][0] < tick - RATE_WINDOW_S:
            entry.samples.popleft()
        return entry

    def _failures(self, entry: _Seen, tick: float) -> FailureSummary | None:
        """The batch's failure reasons, re-read when its failed count moved (not too often:
        reading them visits every job's state)."""
        failed = entry.status.failed
        if not failed:
            entry.failures = None
            return None
        cached = entry.failures
        stale = cached is None or cached.failed != failed
        if stale and tick - entry.failures_at >= FAILURES_RECHECK_S:
            entry.failures = failure_reasons(self.conn, entry.info.batch_id)
            entry.failures_at = tick
        return entry.failures


def _eta(entry: _Seen, tick: float) -> float | None:
    """Seconds until the batch is done at its recent pace; 0 when done, None if unknown."""
    s = entry.status
    if s is None:
        return None
    left = s.total - s.done
    if left <= 0:
        return 0.0
    (t0, d0), (t1, d1) = entry.samples[0], entry.samples[-1]
    if t1 - t0 < 1.0 or d1 <= d0:
        return None
    return left / ((d1 - d0) / (t1 - t0))


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
    return WorkerRow(
        name=w.name,
        host=w.host,
        model=w.model + (" +lora" if w.adapter_path else ""),
        device=f"{w.backend} {w.device}",
        queues=list(w.queues),
        in_flight=w.in_flight,
        in_batch=in_batch,
        waiting=max(0, w.in_flight - in_batch),
        max_batch=w.max_batch,
        kv_used=w.kv_reserved_bytes / w.kv_budget_bytes if w.kv_budget_bytes > 0 else None,
        tokens_per_s=w.recent_tps,
        jobs_done=w.jobs_done,
        jobs_failed=w.jobs_failed,
        heartbeat_age_s=age,
        stalled=w.state == "stalled" or age > STALL_AFTER_S,
    )


def queue_row(qi: QueueInfo, served: dict[str, tuple[int, int]]) -> QueueRow:
    """One queue as the page shows it, flagged when jobs wait and no live worker serves it."""
    live, stalled = served.get(qi.name, (0, 0))
    flag = health.unserved(qi.name, live, stalled) if qi.queued and not live else None
    return QueueRow(qi.name, qi.queued, qi.started, live, qi.oldest_age_s, flag)
