"""What ``mlxq dashboard`` shows: one read-only snapshot of batches, workers and queues.

Everything comes from the broker's readers (``batch_status``, ``live_workers``,
``queue_overview``, ``failure_reasons``) and, for batches made through ``mlxq api``, the
API's batch records (read only, for the ``batch_…`` id its client knows); nothing here
writes to Redis.

What is measured, and what is estimated from it:

- A worker's tokens/s is its own ``recent_tps``: tokens of the jobs it finished over the
  last minute (0 once it is idle). Tokens are counted as jobs end, so a worker holding
  jobs none of which ended in that minute shows "–" (not measured yet), not 0.
- A batch's tokens/s is an estimate: its share, by running jobs, of the rate of the live
  workers on each queue it runs on (workers publish their rate, not a per-batch one).
- A batch's progress is its ended jobs out of its total; its running jobs are shown
  beside it, not counted as partly done (nothing says how far along a running job is).
- Its ETA is its remaining jobs at the pace its jobs ended over the last couple of
  minutes, or, before this process watched it that long, at its pace since submit.
- "no progress for ..." counts from when this process last saw one of its jobs end (or,
  for a batch none of whose jobs ended yet, from its submit).

No web framework here, so the snapshot is usable (and testable) without the ``api`` extra.
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
from mlxq.api import redis_keys as api_keys
from mlxq.api.dashboard_history import RateHistory, Throughput
from mlxq.api.dashboard_rows import (
    BatchRow,
    QueueRow,
    WorkerRow,
    batch_row,
    batch_tps,
    fleet_tps,
    queue_rates,
    queue_row,
    running_by_queue,
    worker_row,
)
from mlxq.api.objects import state_decoder
from mlxq.broker import batches as broker_batches
from mlxq.broker import fleet, keys
from mlxq.broker.failures import FailureSummary, failure_reasons
from mlxq.wire import BatchInfo, BatchStatus, WorkerInfo

MAX_BATCHES = 50  # the most recent batches shown
RATE_WINDOW_S = 120.0  # how far back the ETA's rate looks
DONE_RECHECK_S = 30.0  # a finished batch is re-read this often (a retry can reopen it)
FAILURES_RECHECK_S = 15.0  # failure reasons are re-read at most this often per batch
# Open pages share a snapshot this young: ten tabs cost Redis what one does.
SHARE_S = 1.0


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
    shown_id: str  # the id the page shows (an API batch's ``batch_…``)
    first_tick: float  # when this process first read it
    named: bool = False  # whether its API record (if any) was looked for
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
        self.history = RateHistory()
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
        with self._lock:
            workers = fleet.live_workers(self.conn)
            self.history.sample(fleet_tps(workers, self._wall()), self._clock())

    def _take(self, tick: float) -> Snapshot:
        now = self._wall()
        workers = fleet.live_workers(self.conn)
        now_tps = fleet_tps(workers, now)
        self.history.sample(now_tps, tick)
        rows = [worker_row(w, now) for w in workers]
        stalled = {r.name for r in rows if r.stalled}
        served = health.serving(workers, stalled)
        overview = fleet.queue_overview(self.conn, now=now)
        queues = [queue_row(qi, served) for qi in overview]
        running = {qi.name: qi.started for qi in overview}
        live = [w for w in workers if w.name not in stalled]
        batches = self._batches(now, tick, live, running, served)
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
            throughput=self.history.series(tick, now_tps),
        )

    def _batches(
        self,
        now: float,
        tick: float,
        live: list[WorkerInfo],
        running: dict[str, int],
        served: dict,
    ) -> list[BatchRow]:
        seen = []
        for batch_id in self._recent_ids():
            entry = self._status(batch_id, tick, now)
            if entry is not None:
                seen.append(entry)
        self._seen = {e.info.batch_id: e for e in seen}
        self._name_api_batches([e for e in seen if not e.named])
        # Running jobs per queue: RQ's count, or the batches' own where those add up to more.
        by_batch = {e.info.batch_id: running_by_queue(e.info, e.status) for e in seen}
        summed: dict[str, int] = {}
        for counts in by_batch.values():
            for name, n in counts.items():
                summed[name] = summed.get(name, 0) + n
        running = {k: max(running.get(k, 0), summed.get(k, 0)) for k in running.keys() | summed}
        rates = queue_rates(live, running)
        rows = []
        for e in seen:
            tps, tps_basis = batch_tps(by_batch[e.info.batch_id], running, rates, live)
            eta, eta_basis = _eta(e, tick, now)
            row = batch_row(e.info, e.status, now, tps, eta)
            row.batch_id = e.shown_id
            row.tokens_per_s_basis, row.eta_basis = tps_basis, eta_basis
            row.flags = health.batch_flags(
                e.info, e.status, now - e.progress_at, self.stuck_after_s, served
            )
            row.failures = self._failures(e, tick)
            rows.append(row)
        return rows

    def _name_api_batches(self, entries: list[_Seen]) -> None:
        """Show a batch made through ``mlxq api`` under the ``batch_…`` id its client knows:
        its source names the API batch, whose record names this mlxq batch (read once)."""
        asked = [e for e in entries if (e.info.source or "").startswith(API_SOURCE)]
        ids = [(e.info.source or "").removeprefix(API_SOURCE) for e in asked]
        raws = self.conn.mget([api_keys.batch_record(i) for i in ids]) if ids else []
        for e in entries:
            e.named = True
        for e, api_id, raw in zip(asked, ids, raws, strict=True):
            if raw is None:
                continue
            try:
                state = state_decoder.decode(raw)
            except msgspec.DecodeError:
                continue
            if state.mlxq_batch_id == e.info.batch_id and state.batch.id == api_id:
                e.shown_id = api_id

    def _recent_ids(self) -> list[str]:
        return [b.decode() for b in self.conn.zrevrange(keys.batches(), 0, MAX_BATCHES - 1)]

    def _status(self, batch_id: str, tick: float, now: float) -> _Seen | None:
        entry = self._seen.get(batch_id)
        try:
            if entry is None:
                entry = _Seen(broker_batches.get_batch(self.conn, batch_id), batch_id, tick)
            s = entry.status
            finished = s is not None and s.done >= s.total
            if not finished or tick - entry.read_at >= DONE_RECHECK_S:
                entry.status = broker_batches.batch_status(self.conn, batch_id)
                entry.read_at = tick
        except broker_batches.BatchNotFound:
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


API_SOURCE = "api:"  # the source of a batch ``mlxq api`` submitted: api:<its batch id>


def _eta(entry: _Seen, tick: float, now: float) -> tuple[float | None, str | None]:
    """Seconds until the batch is done, and the pace that assumes (or why there is none);
    0 when done.

    The pace its jobs ended at over the last ``RATE_WINDOW_S`` this process watched; before
    it watched that long and saw none end, the pace since the batch's submit.
    """
    s = entry.status
    if s is None:
        return None, None
    left = s.total - s.done
    if left <= 0:
        return 0.0, None
    (t0, d0), (t1, d1) = entry.samples[0], entry.samples[-1]
    if t1 - t0 >= 1.0 and d1 > d0:
        basis = f"at the pace its jobs ended over the last {health.span(t1 - t0)}"
        return left / ((d1 - d0) / (t1 - t0)), basis
    age = now - entry.info.created_at
    if tick - entry.first_tick < RATE_WINDOW_S and s.done and age >= 1.0:
        basis = f"at its pace since submit ({s.done} ended in {health.span(age)})"
        return left / (s.done / age), basis
    if not s.done:
        return None, "none of its jobs has ended yet"
    return None, f"none of its jobs ended in the last {health.span(RATE_WINDOW_S)}"
