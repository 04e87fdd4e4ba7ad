"""The fleet as Redis sees it: live workers' published info and an overview of every queue.

Each worker publishes a ``WorkerInfo`` under ``keys.worker_info(name)`` with an expiry a
little longer than its heartbeat interval, and adds its name to ``keys.workers()``; a
worker that dies simply stops refreshing and its key expires. Readers prune names whose
key is gone. Everything here only reads RQ's keys (no registry cleanup), so ``mlxq
workers`` and ``mlxq status`` never change the state they report.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import redis
from rq.utils import utcparse

from mlxq.broker import keys
from mlxq.broker.rq_store import lanes, rq_keys
from mlxq.wire import QueueInfo, SeenModel, WorkerInfo, json_encoder

# How many jobs at the head of a queue (and of each of its lanes) are looked at to find its
# oldest one: jobs are appended, so the head is the oldest unless some were put back at the
# front.
OLDEST_SCAN = 16

_worker_decoder = msgspec.json.Decoder(WorkerInfo)
_seen_decoder = msgspec.json.Decoder(SeenModel)

# Drop a name from the set only if its info key is still gone: a worker that
# re-published between our read and the prune keeps its entry.
_PRUNE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return redis.call('SREM', KEYS[2], ARGV[1])
end
return 0
"""


# -- workers ---------------------------------------------------------------------------
def publish(conn: redis.Redis, info: WorkerInfo, ttl: int) -> None:
    """Store ``info`` for ``ttl`` seconds and list the worker by name (one round trip)."""
    if ttl <= 0:
        raise ValueError(f"ttl must be a positive number of seconds, not {ttl!r}")
    with conn.pipeline() as pipe:
        pipe.set(keys.worker_info(info.name), json_encoder.encode(info), ex=int(ttl))
        pipe.sadd(keys.workers(), info.name)
        announce(pipe, info.models or [info.model], info.queues, info.adapter_path)
        pipe.execute()


def announce(
    conn: redis.Redis | redis.client.Pipeline,
    models: list[str],
    queues: list[str],
    adapter: str | None = None,
):
    """Record that a worker serves ``models`` from ``queues`` (from before its model loads:
    work for them is accepted while it starts, and while it sleeps, ``seen_models``), with
    its LoRA ``adapter``: a model with an adapter is recorded apart from the plain model."""
    now = time.time()
    seen = {
        m if adapter is None else f"{m}\0{adapter}": json_encoder.encode(
            SeenModel(m, queues, now, adapter)
        )
        for m in models
    }
    conn.hset(keys.models_seen(), mapping=seen)


def seen_models(conn: redis.Redis, within_s: float = keys.SEEN_FOR_S) -> list[SeenModel]:
    """The models workers served within the last ``within_s`` seconds (live or not)."""
    since = time.time() - within_s
    out = []
    for raw in conn.hvals(keys.models_seen()):
        try:
            seen = _seen_decoder.decode(raw)
        except msgspec.DecodeError:
            continue
        if seen.seen_at >= since:
            out.append(seen)
    return sorted(out, key=lambda s: s.model)


def remove(conn: redis.Redis, name: str) -> None:
    """Forget a worker at once (a clean shutdown; a dead one just expires)."""
    with conn.pipeline() as pipe:
        pipe.delete(keys.worker_info(name))
        pipe.srem(keys.workers(), name)
        pipe.execute()


def live_workers(conn: redis.Redis) -> list[WorkerInfo]:
    """Every worker whose info has not expired, sorted by name; prunes the expired names.

    An entry that cannot be decoded (written by an incompatible version) is skipped, not
    pruned: it expires on its own.
    """
    names = sorted(n.decode() for n in conn.smembers(keys.workers()))
    if not names:
        return []
    raws = conn.mget([keys.worker_info(n) for n in names])
    out: list[WorkerInfo] = []
    stale: list[str] = []
    for name, raw in zip(names, raws, strict=True):
        if raw is None:
            stale.append(name)
            continue
        try:
            out.append(_worker_decoder.decode(raw))
        except msgspec.DecodeError:
            continue
    if stale:
        prune = conn.register_script(_PRUNE_SCRIPT)
        with conn.pipeline(transaction=False) as pipe:
            for name in stale:
                prune(keys=[keys.worker_info(name), keys.workers()], args=[name], client=pipe)
            pipe.execute()
    return sorted(out, key=lambda w: w.name)


# -- queues ----------------------------------------------------------------------------
def queue_names(conn: redis.Redis) -> list[str]:
    """Names of every RQ queue that has ever been enqueued to (RQ's set of queues)."""
    names = [rq_keys.queue_name_of(raw.decode()) for raw in conn.smembers(rq_keys.QUEUES_SET)]
    return sorted(n for n in names if n is not None)


def queue_overview(conn: redis.Redis, now: float | None = None) -> list[QueueInfo]:
    """Every RQ queue with its depth, registry counts and oldest queued job, by name.

    A handful of pipelined round trips, whatever the number of queues. Read-only for RQ:
    registries are counted as they stand (RQ's own ``count`` would clean them up first).
    """
    names = queue_names(conn)
    if not names:
        return []
    now = time.time() if now is None else now
    depths = lanes.waiting(conn, names)  # the RQ list and the batches' lanes
    heads = list(lanes.heads(conn, names, OLDEST_SCAN).values())
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            for registry in rq_keys.registry_keys(name):
                pipe.zcard(registry)
        replies = pipe.execute()
    rows = [[depths[name], *replies[3 * i : 3 * i + 3]] for i, name in enumerate(names)]
    with conn.pipeline(transaction=False) as pipe:
        for ids in heads:
            for job_id in ids:
                pipe.hget(rq_keys.job_key(job_id), "enqueued_at")
        stamps = iter(pipe.execute())
    serving: dict[str, int] = {}
    for worker in live_workers(conn):
        for q in set(worker.queues):
            serving[q] = serving.get(q, 0) + 1
    out = []
    for name, row, ids in zip(names, rows, heads, strict=True):
        oldest = _oldest([next(stamps) for _ in ids])
        out.append(
            QueueInfo(
                name=name,
                queued=row[0],
                started=row[1],
                finished=row[2],
                failed=row[3],
                oldest_enqueued_at=oldest,
                oldest_age_s=None if oldest is None else max(0.0, now - oldest),
                workers=serving.get(name, 0),
            )
        )
    return out


def _oldest(stamps: list[bytes | None]) -> float | None:
    """The earliest of RQ ``enqueued_at`` strings as Unix seconds (None if none parse)."""
    times = []
    for raw in stamps:
        if not raw:
            continue
        try:
            times.append(utcparse(raw.decode()).timestamp())
        except ValueError:
            continue
    return min(times) if times else None


# -- throughput ------------------------------------------------------------------------
class RecentRate:
    """Tokens per second over a sliding window (about a minute), for ``recent_tps``.

    Feed it ``add(tokens)`` as jobs finish (or as tokens are generated); ``rate()`` is the
    tokens added in the last ``window`` seconds divided by the window, or by the time since
    the rate was created when that is shorter (so a worker that just started is not
    under-reported). Times come from ``clock`` (monotonic by default); both methods also
    take an explicit time. Thread-safe.
    """

    def __init__(self, window: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if window <= 0:
            raise ValueError("window must be positive")
        self.window = float(window)
        self._clock = clock
        self._start = clock()
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0
        self._lock = threading.Lock()

    def add(self, tokens: int, at: float | None = None) -> None:
        """Record ``tokens`` generated at time ``at`` (now by default)."""
        if tokens <= 0:
            return
        at = self._clock() if at is None else at
        with self._lock:
            self._events.append((at, tokens))
            self._sum += tokens
            self._expire(at)

    def rate(self, now: float | None = None) -> float:
        """Tokens per second over the window ending at ``now``."""
        now = self._clock() if now is None else now
        with self._lock:
            self._expire(now)
            span = min(self.window, max(1.0, now - self._start))
            return self._sum / span

    def _expire(self, now: float) -> None:
        cutoff = now - self.window
        while self._events and self._events[0][0] <= cutoff:
            self._sum -= self._events.popleft()[1]
