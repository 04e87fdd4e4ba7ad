"""Jobs a batch owns that nothing holds: found, reported and put back (defence in depth).

Every path mlxq knows keeps a waiting or running job in a list or registry
(``rq_store.whereabouts``); recovery sweeps those. This sweep covers the paths it does not
know: a job whose status says ``queued`` or ``started`` while no list or registry holds it is
marked the first time a sweep sees it, and put back on its queue, once, when a later sweep
sees it so ``grace_s`` (a worker's ``--abandon-after``) on.

It is cheap while nothing is lost: per queue, the batches' queued and started counters are
compared with how many entries the queue's places hold; only a queue whose counters say
more jobs than its places hold is read job by job. One worker of the fleet runs it per
interval (a lock), so a fleet of many workers costs the same as one.

``mlxq status`` reports such jobs (:func:`survey`) with plain reads only, so that it answers
on a full Redis, and bounded work whatever the batch's size.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
import redis

from mlxq.broker import batches, keys
from mlxq.broker.rq_store import counters, reads, whereabouts
from mlxq.wire import BatchInfo

log = logging.getLogger("mlxq.broker.recovery")

_info = msgspec.json.Decoder(BatchInfo)
LIVE = ("queued", "started")
LIST_LIMIT = 100  # the most ids `mlxq status` lists
# The most jobs `mlxq status` reads one by one (only when the counters say some are lost).
SCAN_LIMIT = 20_000


def sweep(conn: redis.Redis, queues: Iterable[str], grace_s: float, every_s: float) -> list[str]:
    """Put back the unaccounted jobs of the active batches on ``queues`` (if no other
    worker swept in the last ``every_s`` seconds); returns the ids put back."""
    if not conn.set(keys.audit_lock(), 1, nx=True, px=max(1, int(every_s * 1000))):
        return []
    moved: list[str] = []
    for queue, batch_ids in _active_batches(conn, set(queues)).items():
        owed = _owed(conn, batch_ids)
        if owed == 0 or owed <= whereabouts.holders_count(conn, queue):
            whereabouts.forget_marks(conn, queue)  # every live job can be held: none is lost
            continue
        held = whereabouts.held_ids(conn, queue)
        for batch_id in batch_ids:
            for job_id in _unheld(conn, batch_id, held, queue):
                got = whereabouts.put_back_if_unheld(conn, job_id, queue, batch_id, grace_s)
                if got == "requeued":
                    moved.append(job_id)
                    log.warning(
                        "job %s of batch %s: waiting or running but held by no list or "
                        "registry for %gs; put it back on %s",
                        job_id,
                        batch_id,
                        grace_s,
                        queue,
                    )
    return moved


@dataclass(frozen=True)
class Unaccounted:
    """What ``mlxq status`` reports of a batch: ``ids`` of jobs that nothing holds (at most
    ``LIST_LIMIT``), and ``count``, how many there are (at least, unless ``exact``)."""

    ids: list[str] = field(default_factory=list)
    count: int = 0
    exact: bool = True


def survey(conn: redis.Redis, batch_id: str) -> Unaccounted:
    """The batch's jobs that wait or run by their status while no list or registry holds
    them right now, for ``mlxq status``: plain reads only (it works on a full Redis, and
    writes nothing).

    Bounded: a few round trips compare, per queue, the batch's queued and started counters
    with how many entries the places that can hold its jobs there hold (its lane, the
    queue's list, intermediate list and started registry); only where the counters say
    more jobs than those hold does it read jobs one by one, at most ``SCAN_LIMIT`` of them
    in input order, and it lists at most ``LIST_LIMIT``. A lost job hidden by other
    batches' entries in the queue's shared places is not seen here; the workers' sweep,
    which counts every batch of the queue, still finds it and puts it back."""
    raw = conn.get(keys.batch_info(batch_id))
    if raw is None:
        return Unaccounted()
    queues = _info.decode(raw).queues()
    with conn.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.batch_counts(batch_id))
        pipe.llen(keys.batch_jobs(batch_id))
        counts, listed = pipe.execute()
    total, per_queue = counters.read_counts(counts), counters.read_queue_counts(counts)
    owed = {q: sum(per_queue.get(q, total)[b] for b in LIVE) for q in queues}
    if sum(owed.values()) == 0:
        return Unaccounted()
    room = whereabouts.room_for(conn, batch_id, queues)
    short = {q: owed[q] - room[q] for q in queues if owed[q] > room[q]}
    if not short:
        return Unaccounted()
    # Jobs listed before the places are read never enter a lane again: only those are read.
    held = {q: whereabouts.held_ids(conn, q, batch_id, atomic=False) for q in short}
    ids, scanned = _scan(conn, batch_id, held, min(listed, SCAN_LIMIT))
    exact = scanned >= listed
    count = len(ids) if exact else max(len(ids), sum(short.values()))
    return Unaccounted(ids[:LIST_LIMIT], count, exact)


def find(conn: redis.Redis, batch_id: str) -> list[str]:
    """The ids :func:`survey` lists (empty for a batch with nothing left to run)."""
    return survey(conn, batch_id).ids


def _scan(
    conn: redis.Redis, batch_id: str, held: dict[str, set[str]], upto: int
) -> tuple[list[str], int]:
    """The batch's first ``upto`` jobs that are enqueued on a queue of ``held``, wait or
    run by their status, and that its places hold not (confirmed atomically); and how
    many jobs were read."""
    found: list[str] = []
    scanned = 0
    while scanned < upto:
        end = min(upto, scanned + batches.CHUNK) - 1
        ids = [j.decode() for j in conn.lrange(keys.batch_jobs(batch_id), scanned, end)]
        if not ids:
            break
        scanned += len(ids)
        states = reads.job_states(conn, ids)
        live = [
            j
            for j, s in zip(ids, states, strict=True)
            if s in LIVE and not any(j in h for h in held.values())
        ]
        by_queue: dict[str, list[str]] = defaultdict(list)
        for job_id, origin in zip(live, whereabouts.origins(conn, live), strict=True):
            if origin in held:
                by_queue[origin].append(job_id)
        for queue, candidates in by_queue.items():
            found += whereabouts.unheld(conn, queue, candidates)
    return found, scanned


def _unheld(
    conn: redis.Redis, batch_id: str, held: set[str], queue: str | None = None
) -> list[str]:
    """The batch's live jobs (by status) that are not in ``held`` (only those enqueued on
    ``queue`` if given: a batch mixing models has jobs on several queues)."""
    out: list[str] = []
    for ids in batches.iter_job_id_chunks(conn, batch_id):
        states = reads.job_states(conn, ids)
        live = [j for j, s in zip(ids, states, strict=True) if s in LIVE and j not in held]
        if queue is not None and live:
            origins = whereabouts.origins(conn, live)
            live = [j for j, o in zip(live, origins, strict=True) if o == queue]
        out += live
    return out


def _active_batches(conn: redis.Redis, queues: set[str]) -> dict[str, list[str]]:
    """The batches on ``queues`` that are not cancelled, by queue."""
    batch_ids = [b.decode() for b in conn.zrange(keys.batches(), 0, -1)]
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in batch_ids:
            pipe.get(keys.batch_info(batch_id))
        infos = pipe.execute()
    by_queue: dict[str, list[str]] = defaultdict(list)
    for batch_id, raw in zip(batch_ids, infos, strict=True):
        if raw is None:
            continue
        info = _info.decode(raw)
        for queue in info.queues():  # (a batch mixing models is on several)
            if queue in queues and info.state != "cancelled":
                by_queue[queue].append(batch_id)
    return by_queue


def _owed(conn: redis.Redis, batch_ids: list[str]) -> int:
    """How many of the batches' jobs wait or run, by their counters."""
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in batch_ids:
            pipe.hgetall(keys.batch_counts(batch_id))
        counts = [counters.read_counts(raw) for raw in pipe.execute()]
    return sum(c["queued"] + c["started"] for c in counts)
