"""What ``mlxq dashboard`` shows: one read-only snapshot of batches, workers and queues.

Everything comes from the broker's readers (``batch_status``, ``live_workers``,
``queue_overview``); nothing here writes to Redis. A batch's tokens/s is an estimate: the
recent tokens/s of the live workers on its queue, shared among that queue's batches that
have jobs running (workers publish their rate, not a per-batch one). Its ETA comes from
how fast its jobs got done over the last couple of minutes, as this process saw it.
No web framework here, so the snapshot is usable (and testable) without the ``api`` extra.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import redis

from mlxq.broker import batches as q
from mlxq.broker import fleet, keys
from mlxq.wire import BatchInfo, BatchStatus, WorkerInfo

MAX_BATCHES = 50  # the most recent batches shown
RATE_WINDOW_S = 120.0  # how far back the ETA's rate looks
DONE_RECHECK_S = 30.0  # a finished batch is re-read this often (a retry can reopen it)
# A worker publishes every ~2 s; one silent for this long is stuck in a step or wedged.
STALL_AFTER_S = 10.0
# Open pages share a snapshot this young: ten tabs cost Redis what one does.
SHARE_S = 1.0


class BatchRow(msgspec.Struct):
    batch_id: str
    queue: str
    model: str | None
    source: str | None
    state: str  # queued, running, done
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


class WorkerRow(msgspec.Struct):
    name: str
    host: str
    model: str
    device: str
    queues: list[str]
    in_flight: int
    max_batch: int
    tokens_per_s: float
    jobs_done: int
    jobs_failed: int
    heartbeat_age_s: float
    stalled: bool


class QueueRow(msgspec.Struct):
    name: str
    depth: int
    running: int
    workers: int
    oldest_age_s: float | None


class Snapshot(msgspec.Struct):
    now: float
    batches: list[BatchRow]
    workers: list[WorkerRow]
    queues: list[QueueRow]


@dataclass
class _Seen:
    """What this process remembers of one batch between snapshots."""

    info: BatchInfo
    samples: deque[tuple[float, int]] = field(default_factory=deque)
    status: BatchStatus | None = None
    read_at: float = 0.0


class Dashboard:
    """Takes snapshots; remembers batch progress over time for the ETAs. Thread-safe."""

    def __init__(self, conn: redis.Redis, clock=time.monotonic) -> None:
        self.conn = conn
        self._clock = clock
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

    def _take(self, tick: float) -> Snapshot:
        now = time.time()
        workers = fleet.live_workers(self.conn)
        queues = fleet.queue_overview(self.conn, now=now)
        batches = self._batches(now, tick, workers)
        return Snapshot(
            now=now,
            batches=batches,
            workers=[worker_row(w, now) for w in workers],
            queues=[
                QueueRow(qi.name, qi.queued, qi.started, qi.workers, qi.oldest_age_s)
                for qi in queues
            ],
        )

    def _batches(self, now: float, tick: float, workers: list[WorkerInfo]) -> list[BatchRow]:
        seen = []
        for batch_id in self._recent_ids():
            entry = self._status(batch_id, tick)
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
            rows.append(batch_row(e.info, e.status, now, tps, _eta(e, tick)))
        return rows

    def _recent_ids(self) -> list[str]:
        return [b.decode() for b in self.conn.zrevrange(keys.batches(), 0, MAX_BATCHES - 1)]

    def _status(self, batch_id: str, tick: float) -> _Seen | None:
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
        entry.samples.append((tick, entry.status.done))
        while entry.samples and entry.samples[0][0] < tick - RATE_WINDOW_S:
            entry.samples.popleft()
        return entry


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
        state = "done"
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
    )


def worker_row(w: WorkerInfo, now: float) -> WorkerRow:
    """One worker as the page shows it; ``stalled`` is the worker's own flag when it
    publishes one, else a heartbeat older than ``STALL_AFTER_S``."""
    age = max(0.0, now - w.heartbeat_at)
    flag = getattr(w, "stalled", None)
    return WorkerRow(
        name=w.name,
        host=w.host,
        model=w.model + (" +lora" if w.adapter_path else ""),
        device=f"{w.backend} {w.device}",
        queues=list(w.queues),
        in_flight=w.in_flight,
        max_batch=w.max_batch,
        tokens_per_s=w.recent_tps,
        jobs_done=w.jobs_done,
        jobs_failed=w.jobs_failed,
        heartbeat_age_s=age,
        stalled=bool(flag) if flag is not None else age > STALL_AFTER_S,
    )
