"""Queue I/O: submitting batches as RQ jobs and reading their state and results back.

Every request is one RQ job on a named queue (so ``rq info``, RQ's registries and
``Job.fetch`` see it). A submit's jobs form a batch whose job ids are kept, in input
order, under ``keys.batch_jobs``. All Redis traffic here is pipelined in chunks.
"""

from __future__ import annotations

import base64
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence

import msgspec
import redis
from rq import Queue, Retry
from rq.job import Job

from mlxq.broker import keys
from mlxq.broker.serializer import serializer
from mlxq.wire import BatchInfo, BatchStatus, JobMeta, Request, Result, json_encoder

CHUNK = 1000

_batch_info_decoder = msgspec.json.Decoder(BatchInfo)
_meta_decoder = msgspec.json.Decoder(JobMeta)


class BatchNotFound(LookupError):
    """No batch with this id in Redis (never submitted, or expired)."""


def connect(url: str) -> redis.Redis:
    """A Redis client for ``url`` (``redis://``, ``rediss://`` or ``unix://``)."""
    if url.startswith("unix://"):  # TCP keepalive does not apply to a socket file
        return redis.Redis.from_url(url, health_check_interval=30)
    return redis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)


def make_queue(conn: redis.Redis, name: str) -> Queue:
    """An RQ queue using mlxq's JSON serializer (never pickle)."""
    return Queue(name, connection=conn, serializer=serializer)


def new_batch_id() -> str:
    """A short, unique, URL-safe batch id."""
    return "b" + uuid.uuid4().hex[:16]


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
    on_progress: Callable[[int], None] | None = None,
) -> BatchInfo:
    """Enqueue ``requests`` as one batch of RQ jobs and return the batch record.

    ``expires_in`` seconds after submit, requests that have not started are not run
    (their results say ``expired``).
    """
    created = time.time()
    info = BatchInfo(
        batch_id=batch_id or new_batch_id(),
        queue=queue,
        total=len(requests),
        created_at=created,
        source=source,
        model=model,
        expires_at=created + expires_in if expires_in else None,
    )
    q = make_queue(conn, queue)
    retry = Retry(max=retries) if retries > 0 else None
    for start in range(0, len(requests), CHUNK):
        chunk = requests[start : start + CHUNK]
        datas = [
            _job_data(req, info, start + i, retry, job_timeout, result_ttl)
            for i, req in enumerate(chunk)
        ]
        with conn.pipeline() as pipe:
            jobs = q.enqueue_many(datas, pipeline=pipe)
            pipe.rpush(keys.batch_jobs(info.batch_id), *[j.id for j in jobs])
            pipe.expire(keys.batch_jobs(info.batch_id), keys.BATCH_TTL)
            pipe.execute()
        if on_progress:
            on_progress(len(chunk))
    with conn.pipeline() as pipe:
        pipe.set(keys.batch_info(info.batch_id), json_encoder.encode(info), ex=keys.BATCH_TTL)
        pipe.zadd(keys.batches(), {info.batch_id: info.created_at})
        pipe.execute()
    return info


def _job_data(
    req: Request, info: BatchInfo, index: int, retry: Retry | None, timeout: int, result_ttl: int
):  # -> rq EnqueueData
    batch_id = info.batch_id
    meta = JobMeta(
        batch_id=batch_id, index=index, custom_id=req.custom_id, expires_at=info.expires_at
    )
    return Queue.prepare_data(
        keys.JOB_FUNC,
        args=(msgspec.to_builtins(req),),
        timeout=timeout,
        result_ttl=result_ttl,
        failure_ttl=result_ttl,
        description=req.custom_id or f"{batch_id}[{index}]",
        meta=msgspec.to_builtins(meta),
        retry=retry,
    )


def get_batch(conn: redis.Redis, batch_id: str) -> BatchInfo:
    """The stored record of a batch, or ``BatchNotFound``."""
    raw = conn.get(keys.batch_info(batch_id))
    if raw is None:
        raise BatchNotFound(
            f"no batch {batch_id!r} on this Redis (check the id and --redis-url; "
            f"batches expire {keys.BATCH_TTL // 86400} days after submit)"
        )
    return _batch_info_decoder.decode(raw)


def batch_job_ids(conn: redis.Redis, batch_id: str) -> list[str]:
    """The batch's job ids in input order."""
    return [j.decode() for j in conn.lrange(keys.batch_jobs(batch_id), 0, -1)]


def _chunks(items: Sequence[str], n: int = CHUNK) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), n):
        yield items[start : start + n]


def job_states(conn: redis.Redis, job_ids: Sequence[str]) -> list[str]:
    """RQ status of each job (``expired`` when its hash is gone)."""
    states: list[str] = []
    for chunk in _chunks(job_ids):
        with conn.pipeline(transaction=False) as pipe:
            for jid in chunk:
                pipe.hget(f"rq:job:{jid}", "status")
            states.extend(s.decode() if s else "expired" for s in pipe.execute())
    return states


_STATE_FIELD = {
    "queued": "queued",
    "deferred": "queued",
    "scheduled": "queued",
    "created": "queued",
    "started": "started",
    "finished": "finished",
    "failed": "failed",
    "stopped": "failed",
    "canceled": "cancelled",
}


def batch_status(conn: redis.Redis, batch_id: str) -> BatchStatus:
    """Counts of the batch's jobs by state."""
    info = get_batch(conn, batch_id)
    counts = dict.fromkeys(("queued", "started", "finished", "failed", "cancelled", "other"), 0)
    for state in job_states(conn, batch_job_ids(conn, batch_id)):
        counts[_STATE_FIELD.get(state, "other")] += 1
    return BatchStatus(batch_id=batch_id, total=info.total, **counts)


def fetch_results(conn: redis.Redis, job_ids: Sequence[str]) -> list[Result | None]:
    """The result of each job, or None while it has none yet (queued or running)."""
    out: list[Result | None] = []
    for chunk in _chunks(job_ids):
        with conn.pipeline(transaction=False) as pipe:
            for jid in chunk:
                pipe.hmget(f"rq:job:{jid}", "status", "meta")
                pipe.xrevrange(f"rq:results:{jid}", "+", "-", count=1)
            replies = pipe.execute()
        for jid, (status_meta, latest) in zip(chunk, _pairs(replies), strict=True):
            out.append(_to_result(jid, status_meta, latest))
    return out


def _pairs(replies: list) -> Iterator[tuple]:
    it = iter(replies)
    return zip(it, it, strict=True)


_TERMINAL = ("finished", "failed", "stopped", "canceled", "expired")


def _to_result(job_id: str, status_meta: list, latest: list) -> Result | None:
    status = status_meta[0].decode() if status_meta[0] else "expired"
    if status not in _TERMINAL:
        return None  # queued, running, or waiting for a retry
    payload = latest[0][1] if latest else {}
    if b"return_value" in payload:
        data = serializer.loads(base64.b64decode(payload[b"return_value"]))
        return msgspec.convert(data, Result)
    meta = _meta_decoder.decode(status_meta[1]) if status_meta[1] else JobMeta()
    return Result(
        job_id=job_id,
        custom_id=meta.custom_id,
        finish_reason="cancelled" if status == "canceled" else "error",
        error=_failure_message(payload) or _STATUS_ERRORS.get(status, status),
        batch_id=meta.batch_id,
        index=meta.index,
    )


_STATUS_ERRORS = {
    "canceled": "cancelled before it finished",
    "stopped": "stopped before it finished",
    "expired": "the job expired from Redis before a result was collected",
    "failed": "failed without an error message",
}


def _failure_message(payload: dict) -> str | None:
    """The last line of an RQ failure's exception text (the message, not the traceback)."""
    raw = payload.get(b"exc_string")
    if not raw:
        return None
    text = zlib.decompress(base64.b64decode(raw)).decode(errors="replace").strip()
    return text.splitlines()[-1] if text else None


def iter_batch_results(conn: redis.Redis, batch_id: str) -> Iterator[Result | None]:
    """The batch's results in input order; None for jobs not done yet."""
    get_batch(conn, batch_id)
    yield from fetch_results(conn, batch_job_ids(conn, batch_id))


def wait_for_batch(
    conn: redis.Redis,
    batch_id: str,
    *,
    timeout: float | None = None,
    poll: float = 0.5,
    on_progress: Callable[[BatchStatus], None] | None = None,
) -> BatchStatus:
    """Poll until every job of the batch is done (or ``timeout`` seconds pass)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = _retrying(lambda: batch_status(conn, batch_id))
        if on_progress:
            on_progress(status)
        if status.done + status.other >= status.total:
            return status
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(
                f"batch {batch_id}: {status.done} of {status.total} done after {timeout:g}s "
                f"(is a worker running on queue {get_batch(conn, batch_id).queue!r}?)"
            )
        time.sleep(poll)


def _retrying(fn: Callable, attempts: int = 8):
    """Call ``fn``, riding out Redis restarts and dropped connections with backoff."""
    delay = 0.5
    for attempt in range(attempts):
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError):
            if attempt == attempts - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
    raise AssertionError("unreachable")


def cancel_jobs(conn: redis.Redis, job_ids: Sequence[str]) -> tuple[int, int]:
    """Cancel jobs: queued ones leave their queue at once, running ones are flagged and
    stopped by their worker at its next check. Returns (dequeued, flagged)."""
    dequeued = flagged = 0
    for jid, state in zip(job_ids, job_states(conn, job_ids), strict=True):
        if state in ("queued", "deferred", "scheduled", "created"):
            Job.fetch(jid, connection=conn, serializer=serializer).cancel()
            dequeued += 1
        elif state == "started":
            conn.set(keys.cancel_flag(jid), 1, ex=keys.BATCH_TTL)
            flagged += 1
    return dequeued, flagged


def retry_failed(conn: redis.Redis, job_ids: Sequence[str]) -> int:
    """Put the failed jobs among ``job_ids`` back on their queues; returns how many."""
    count = 0
    for jid, state in zip(job_ids, job_states(conn, job_ids), strict=True):
        if state == "failed":
            job = Job.fetch(jid, connection=conn, serializer=serializer)
            job.failed_job_registry.requeue(job)
            count += 1
    return count
