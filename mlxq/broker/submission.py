"""Submitting a batch: the record first, then its jobs in chunks, resumable.

The batch record is written before any job (state ``submitting``), so a submit that dies
half way leaves a batch that ``mlxq status`` shows with how many were enqueued. Each chunk
of jobs, their ids in the batch's list and their counters are one transaction, so the jobs
enqueued are always the first N by index: ``resume`` enqueues from N on, none twice. A
short-lived key (``keys.batch_submitter``), refreshed per chunk, is the submit's lease: it
tells a live submit from a dead one, and every chunk is written only while its submit still
holds it (checked inside the chunk's transaction), so a submit paused past its lease while a
``resume`` took over stops instead of enqueueing its lines a second time.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence

import msgspec
import redis
from rq import Queue, Retry

from mlxq.broker import keys, routing
from mlxq.broker.batch_record import CHUNK, decode_info, get_batch, new_batch_id
from mlxq.broker.rq_store import counters, lanes
from mlxq.errors import StartupError
from mlxq.wire import BatchInfo, BatchModel, JobMeta, Request, json_encoder


class ResumeRefused(ValueError):
    """A ``--resume`` that cannot go ahead (different file, already complete, cancelled)."""


class LeaseLost(StartupError):
    """Another submit took the batch over while this one was paused past its lease; this one
    stopped before writing anything twice (reported as one line, like a start-up error)."""


def submit(
    conn: redis.Redis,
    requests: Sequence[Request],
    *,
    queue: str = keys.DEFAULT_QUEUE,
    batch_id: str | None = None,
    retries: int = 0,
    job_timeout: int = keys.DEFAULT_JOB_TIMEOUT,
    result_ttl: int = keys.DEFAULT_RESULT_TTL,
    source: str | None = None,
    model: str | None = None,
    expires_in: float | None = None,
    priority: str = keys.DEFAULT_PRIORITY,
    on_progress: Callable[[int], None] | None = None,
    on_created: Callable[[BatchInfo], None] | None = None,
    on_jobs: Callable[[list[str]], None] | None = None,
    queue_of: Callable[[str], str] = keys.queue_name_for_model,
    models: Sequence[BatchModel] | None = None,
) -> BatchInfo:
    """Enqueue ``requests`` as one batch of RQ jobs and return the batch record.

    ``models`` is the routing plan (:func:`mlxq.broker.routing.plan` of these requests);
    without it, one is made from the fleet: a request naming a model goes to a queue whose
    workers serve it (``queue`` first, else the model's own queue; with ``queue_of``, to
    ``queue_of`` the model), one naming none (or ``model``) to ``queue``. The plan is kept
    in the record, so a resume routes the rest the same way.

    The record comes first (state ``submitting``; ``on_created`` is called with it), then
    the jobs in chunks, each chunk in one transaction with its ids and counters, so a
    submit cut short leaves a batch that ``resume`` completes or ``cancel_batch`` removes.
    ``expires_in`` seconds after submit, requests that have not started are not run
    (their results say ``expired``). ``on_jobs`` gets each chunk's job ids. Workers take a
    higher ``priority``'s jobs first (high, normal, low) and share out equal batches a job
    at a time (:mod:`~mlxq.broker.rq_store.lanes`).
    """
    lanes.check_priority(priority)
    if models is None:  # (a run's private queues are its own: no fleet to route to)
        fleet = routing.Fleet.read(conn) if queue_of is keys.queue_name_for_model else None
        models = routing.plan(requests, queue, model, queue_of, fleet=fleet)
    elif sum(m.lines for m in models) != len(requests):
        raise ValueError(
            f"the routing plan has {sum(m.lines for m in models)} lines for "
            f"{len(requests)} requests"
        )
    created = time.time()
    lease = _new_lease()
    info = BatchInfo(
        batch_id=batch_id or new_batch_id(),
        queue=queue,
        total=len(requests),
        created_at=created,
        source=source,
        model=model,
        expires_at=created + expires_in if expires_in else None,
        state="submitting",
        digest=requests_digest(requests),
        retries=retries,
        job_timeout=job_timeout,
        result_ttl=result_ttl,
        models=list(models),
        priority=priority,
    )
    with conn.pipeline() as pipe:
        pipe.set(keys.batch_submitter(info.batch_id), lease, ex=SUBMITTER_TTL)
        pipe.set(keys.batch_info(info.batch_id), json_encoder.encode(info), ex=keys.BATCH_TTL)
        pipe.zadd(keys.batches(), {info.batch_id: info.created_at})
        pipe.execute()
    if on_created:
        on_created(info)
    return _enqueue_rest(conn, info, requests, 0, lease, on_progress, on_jobs)


def resume(
    conn: redis.Redis,
    batch_id: str,
    requests: Sequence[Request],
    on_progress: Callable[[int], None] | None = None,
) -> tuple[BatchInfo, int]:
    """Enqueue what an interrupted submit of ``requests`` left out (by index, none twice);
    returns the record and how many were already enqueued."""
    info = get_batch(conn, batch_id)
    if info.state == "cancelled":
        raise ResumeRefused(f"batch {batch_id} was cancelled; submit the file as a new batch")
    if info.digest is not None and (
        len(requests) != info.total or requests_digest(requests) != info.digest
    ):
        raise ResumeRefused(
            f"these {len(requests)} requests are not the ones batch {batch_id} was made from "
            f"({info.total} requests from {info.source or 'another file'}); resume with the "
            "same file (and the same --skip-invalid)"
        )
    lease = _new_lease()
    if not conn.set(keys.batch_submitter(batch_id), lease, ex=SUBMITTER_TTL, nx=True):
        raise ResumeRefused(
            f"batch {batch_id} is still being submitted by {_who(conn, batch_id)}; wait for it"
        )
    done = conn.llen(keys.batch_jobs(batch_id))
    if on_progress and done:
        on_progress(done)
    return _enqueue_rest(conn, info, requests, done, lease, on_progress, None), done


SUBMITTER_TTL = 30  # a submit that stops refreshing this for 30 s is taken for dead
_LEASE_SEP = " lease "  # the lease's value: who holds it, then a token only that submit knows


def _new_lease() -> bytes:
    who = f"pid {os.getpid()} on {socket.gethostname()}"
    return f"{who}{_LEASE_SEP}{secrets.token_hex(8)}".encode()


def _holder(raw: bytes | None) -> str:
    """Who holds a lease, for messages (its token left out)."""
    return raw.decode(errors="replace").split(_LEASE_SEP)[0] if raw else "another process"


def _who(conn: redis.Redis, batch_id: str) -> str:
    return _holder(conn.get(keys.batch_submitter(batch_id)))


def requests_digest(requests: Sequence[Request]) -> str:
    """A short fingerprint of the requests, in order."""
    h = hashlib.sha256()
    for req in requests:
        h.update(json_encoder.encode(req))
        h.update(b"\n")
    return h.hexdigest()[:32]


class BatchCancelled(Exception):
    """The batch was cancelled while it was being submitted."""


def _enqueue_rest(
    conn: redis.Redis,
    info: BatchInfo,
    requests: Sequence[Request],
    start: int,
    lease: bytes,
    on_progress: Callable[[int], None] | None,
    on_jobs: Callable[[list[str]], None] | None,
) -> BatchInfo:
    retry = Retry(max=info.retries) if info.retries > 0 else None
    try:
        for at in range(start, len(requests), CHUNK):
            chunk = requests[at : at + CHUNK]
            datas = [_job_data(req, info, at + i, retry) for i, req in enumerate(chunk)]
            routed = routing.queues_of(chunk, info)
            ids = _enqueue_chunk(conn, routed, info, datas, at, lease)
            if on_jobs:
                on_jobs(ids)
            if on_progress:
                on_progress(len(chunk))
        return _mark_submitted(conn, info)
    finally:
        _let_go(conn, info.batch_id, lease)


def _enqueue_chunk(
    conn: redis.Redis, routed: list[str], info: BatchInfo, datas: list, at: int, lease: bytes
) -> list[str]:
    """One chunk of jobs (each onto its queue named in ``routed``), their ids and their counters in
    one transaction, written only if the batch is not cancelled and this submit still holds
    its lease with the batch's first ``at`` jobs enqueued. The record, the lease and the job
    list are watched, so a cancel or a ``resume`` taking over between the look and the write
    aborts the write."""
    batch_id = info.batch_id
    watched = (keys.batch_info(batch_id), keys.batch_submitter(batch_id), keys.batch_jobs(batch_id))
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(*watched)
                raw = pipe.get(keys.batch_info(batch_id))
                if raw is None or decode_info(raw).state == "cancelled":
                    raise BatchCancelled(f"batch {batch_id} was cancelled while submitting")
                _check_lease(pipe, batch_id, at, lease)
                pipe.multi()
                ids = _enqueue_routed(conn, pipe, routed, datas, info)
                pipe.rpush(keys.batch_jobs(batch_id), *ids)
                pipe.expire(keys.batch_jobs(batch_id), keys.BATCH_TTL)
                counters.mark_submitted(pipe, ids, batch_id, routed)
                pipe.set(keys.batch_submitter(batch_id), lease, ex=SUBMITTER_TTL)
                pipe.execute()
                return ids
            except redis.WatchError:
                pipe.reset()


def _enqueue_routed(
    conn: redis.Redis,
    pipe: redis.client.Pipeline,
    routed: list[str],
    datas: list,
    info: BatchInfo,
) -> list[str]:
    """Queue, in ``pipe``, each job onto the batch's lane of its queue (a group per queue,
    ``lanes``); the ids in input order."""
    ids: list[str] = [""] * len(datas)
    groups: dict[str, list[int]] = {}
    for i, queue in enumerate(routed):
        groups.setdefault(queue, []).append(i)
    for queue, where in groups.items():
        group = [datas[i] for i in where]
        jobs = lanes.enqueue(conn, pipe, queue, info.batch_id, info.priority, group)
        for i, job in zip(where, jobs, strict=True):
            ids[i] = job.id
    return ids


def _check_lease(pipe: redis.client.Pipeline, batch_id: str, at: int, lease: bytes) -> None:
    """Raise :class:`LeaseLost` unless the lease is this submit's (or lapsed with nobody
    taking it) and exactly the ``at`` jobs before this chunk are enqueued."""
    holder = pipe.get(keys.batch_submitter(batch_id))
    enqueued = pipe.llen(keys.batch_jobs(batch_id))
    if holder in (None, lease) and enqueued == at:
        return
    by = f" ({_holder(holder)})" if holder not in (None, lease) else ""
    raise LeaseLost(
        f"batch {batch_id}: another submit{by} took over while this one was paused past its "
        f"{SUBMITTER_TTL} s lease; this one stopped at line {at + 1} without enqueueing "
        f"anything twice (see `mlxq status {batch_id}`)"
    )


def _let_go(conn: redis.Redis, batch_id: str, lease: bytes) -> None:
    """Delete the lease if it is still this submit's (never another submit's)."""
    with conn.pipeline() as pipe:
        try:
            pipe.watch(keys.batch_submitter(batch_id))
            if pipe.get(keys.batch_submitter(batch_id)) == lease:
                pipe.multi()
                pipe.delete(keys.batch_submitter(batch_id))
                pipe.execute()
        except redis.WatchError:
            pass  # taken over meanwhile: it is not ours to delete


def _mark_submitted(conn: redis.Redis, info: BatchInfo) -> BatchInfo:
    """The record as ``submitted`` (unless cancelled meanwhile)."""
    done = msgspec.structs.replace(info, state="submitted")
    with conn.pipeline() as pipe:
        try:
            pipe.watch(keys.batch_info(info.batch_id))
            raw = pipe.get(keys.batch_info(info.batch_id))
            current = decode_info(raw) if raw else info
            if current.state != "submitting":
                return current
            pipe.multi()
            pipe.set(keys.batch_info(info.batch_id), json_encoder.encode(done), keepttl=True)
            pipe.execute()
            return done
        except redis.WatchError:
            return get_batch(conn, info.batch_id)  # cancelled in the meantime


def _job_data(req: Request, info: BatchInfo, index: int, retry: Retry | None):  # EnqueueData
    batch_id = info.batch_id
    meta = JobMeta(
        batch_id=batch_id, index=index, custom_id=req.custom_id, expires_at=info.expires_at
    )
    ttl = info.result_ttl or keys.DEFAULT_RESULT_TTL
    return Queue.prepare_data(
        keys.JOB_FUNC,
        args=(msgspec.to_builtins(req),),
        timeout=info.job_timeout or keys.DEFAULT_JOB_TIMEOUT,
        result_ttl=ttl,
        failure_ttl=ttl,
        description=req.custom_id or f"{batch_id}[{index}]",
        meta=msgspec.to_builtins(meta),
        retry=retry,
    )
