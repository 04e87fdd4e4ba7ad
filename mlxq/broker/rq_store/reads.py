"""Reading jobs from RQ: their states, mlxq metas and stored results, many per round trip."""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import redis

from mlxq.broker.rq_store.rq_keys import job_key, results_key
from mlxq.broker.rq_store.states import ENDED, GONE
from mlxq.broker.serializer import serializer
from mlxq.wire import JobMeta, Result

CHUNK = 1000


def chunks(items: Sequence[str], n: int = CHUNK) -> Iterator[Sequence[str]]:
    """``items`` in slices of ``n``, so no one round trip grows with the batch."""
    for start in range(0, len(items), n):
        yield items[start : start + n]


def job_states(conn: redis.Redis, job_ids: Sequence[str]) -> list[str]:
    """RQ status of each job (``GONE`` when its hash is no longer there)."""
    states: list[str] = []
    for chunk in chunks(job_ids):
        with conn.pipeline(transaction=False) as pipe:
            for jid in chunk:
                pipe.hget(job_key(jid), "status")
            states.extend(s.decode() if s else GONE for s in pipe.execute())
    return states


def job_exists(conn: redis.Redis, job_id: str) -> bool:
    """Whether RQ still has the job."""
    return bool(conn.exists(job_key(job_id)))


def job_status(conn: redis.Redis, job_id: str) -> str:
    """The job's RQ status, or ``GONE``."""
    raw = conn.hget(job_key(job_id), "status")
    return raw.decode() if raw else GONE


def job_metas(conn: redis.Redis, job_ids: Sequence[str]) -> list[JobMeta]:
    """The mlxq meta of each job (empty when gone or unreadable)."""
    with conn.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.hget(job_key(jid), "meta")
        return [_meta(raw) for raw in pipe.execute()]


def batch_id_of(conn: Any, job_id: str) -> str | None:
    """The batch of a job, read from its hash."""
    return _meta(conn.hget(job_key(job_id), "meta")).batch_id


def _meta(raw: bytes | None) -> JobMeta:
    try:
        return msgspec.convert(serializer.loads(raw or b"{}"), JobMeta)
    except (msgspec.MsgspecError, TypeError, ValueError):
        return JobMeta()


def read_results(conn: redis.Redis, job_ids: Sequence[str]) -> list[Result | None]:
    """The stored result of each job, or None while it has none (queued or running)."""
    with conn.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.hmget(job_key(jid), "status", "meta")
            pipe.xrevrange(results_key(jid), "+", "-", count=1)
        replies = pipe.execute()
    it = iter(replies)
    return [_result(jid, sm, latest) for jid, sm, latest in zip(job_ids, it, it, strict=False)]


def _result(job_id: str, status_meta: list, latest: list) -> Result | None:
    status = status_meta[0].decode() if status_meta[0] else GONE
    if status not in ENDED and status != GONE:
        return None  # queued, running, or waiting for a retry
    payload = latest[0][1] if latest else {}
    if b"return_value" in payload:
        data = serializer.loads(base64.b64decode(payload[b"return_value"]))
        return msgspec.convert(data, Result)
    return _unrecorded(job_id, status, _meta(status_meta[1]), payload)


_UNRECORDED = {
    "canceled": "cancelled before it finished",
    "stopped": "stopped before it finished",
    GONE: "the job expired from Redis before a result was collected",
    "failed": "failed without an error message",
}


def _unrecorded(job_id: str, status: str, meta: JobMeta, payload: dict) -> Result:
    """The result of a job that ended without one stored by mlxq: its hash expired, or RQ
    itself (or an older mlxq) ended it. Only what RQ kept can be said."""
    return Result(
        job_id=job_id,
        custom_id=meta.custom_id,
        finish_reason="cancelled" if status == "canceled" else "error",
        error=_failure_message(payload) or _UNRECORDED.get(status, status),
        batch_id=meta.batch_id,
        index=meta.index,
    )


def _failure_message(payload: dict) -> str | None:
    """The last line of an RQ failure's exception text (the message, not the traceback)."""
    raw = payload.get(b"exc_string")
    if not raw:
        return None
    text = zlib.decompress(base64.b64decode(raw)).decode(errors="replace").strip()
    return text.splitlines()[-1] if text else None
