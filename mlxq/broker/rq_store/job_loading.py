"""Reading pulled jobs' hashes into RQ ``Job`` objects, one job at a time, so that a hash
another producer wrote badly fails alone instead of taking its group (or the worker) down.

RQ's ``Job.fetch_many`` raises for the whole group on the first bad field (a date that does
not parse, a ``timeout`` that is not a number, an unknown ``status``), and ``Job.restore``
inflates the zlib payload with no bound: a 0.78 MB payload can inflate to gigabytes. Here a
payload is inflated with a bound first, then restored; anything that fails is an
:class:`Unreadable` to be failed with its reason (``fail_unreadable``).

Assumptions about RQ 3.0: a job is the hash ``Job.key_for(id)`` whose ``data`` field is the
(zlib-compressed, else plain) serialized payload that ``Job.restore`` reads, ``status`` its
state and ``meta`` the serialized meta.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from rq.job import Job
from rq.queue import Queue

from mlxq.broker.rq_store import transitions
from mlxq.broker.rq_store.pull import drop_from_intermediate
from mlxq.broker.rq_store.rq_keys import job_key
from mlxq.broker.rq_store.states import ENDED
from mlxq.broker.serializer import serializer

log = logging.getLogger("mlxq.broker.intake")


@dataclass
class Unreadable:
    """A pulled job whose hash cannot be made into a job this worker could run."""

    job_id: str
    queue: Queue
    reason: str
    raw: dict[bytes, bytes]


def load(
    conn: redis.Redis, queue: Queue, ids: Sequence[str], max_bytes: int
) -> list[Job | Unreadable | None]:
    """Each pulled id's job (None where its hash is gone), read in one round trip; a job
    whose payload inflates past ``max_bytes`` or whose fields RQ cannot read is an
    :class:`Unreadable`."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hgetall(job_key(job_id))
        raws = pipe.execute()
    return [
        _restore(conn, queue, job_id, raw, max_bytes) if raw else None
        for job_id, raw in zip(ids, raws, strict=True)
    ]


def _restore(
    conn: redis.Redis, queue: Queue, job_id: str, raw: dict[bytes, bytes], max_bytes: int
) -> Job | Unreadable:
    try:
        too_big = _inflated_size_over(raw.get(b"data", b""), max_bytes)
        if too_big:
            return Unreadable(job_id, queue, too_big, raw)
        job = Job(job_id, connection=conn, serializer=serializer)
        job.restore(raw)
    except Exception as e:  # any field RQ cannot parse: this job only
        return Unreadable(job_id, queue, f"RQ cannot read the job's hash ({e!r:.200})", raw)
    return job


def _inflated_size_over(data: bytes, max_bytes: int) -> str | None:
    """Why the payload is too large, or None; inflates at most ``max_bytes`` + 1 bytes."""
    try:
        size = len(zlib.decompressobj().decompress(data, max_bytes + 1))
    except zlib.error:
        size = len(data)  # stored uncompressed (RQ falls back the same way)
    if size <= max_bytes:
        return None
    return (
        f"job payload inflates past {max_bytes:,} bytes (the worker's --max-job-bytes); "
        "split the request or raise the limit"
    )


def fail_unreadable(conn: redis.Redis, item: Unreadable, worker_name: str) -> None:
    """End a job that cannot be read: failed, with its reason as its error result, in RQ's
    failed registry and its batch's counter, and out of the intermediate list (whatever its
    status says, unless it ended: cancelled meanwhile, it is only dropped from the list). An
    id RQ cannot even name is dropped and logged."""
    status = item.raw.get(b"status", b"queued")
    try:
        job = Job(item.job_id, connection=conn, serializer=serializer)
    except (TypeError, ValueError):
        drop_from_intermediate(conn, item.queue, item.job_id)
        log.error("job id %r is not a valid RQ job id; dropped it: %s", item.job_id, item.reason)
        return
    if status.decode(errors="replace") in ENDED:  # cancelled meanwhile: nothing to run
        drop_from_intermediate(conn, item.queue, item.job_id)
        return
    job.origin = item.queue.name
    job.meta = _tolerant_meta(item.raw.get(b"meta"))
    result = transitions.result_without_output(job, "error", item.reason, worker=worker_name)
    with conn.pipeline() as pipe:
        transitions.end_job(pipe, job, item.queue, result)
        pipe.lrem(item.queue.intermediate_queue_key, 1, item.job_id)
        pipe.execute()
    log.error("job %s failed: %s", item.job_id, item.reason)


# The meta fields a failure's result carries, with the type each must have to be kept.
_META_TYPES = {"batch_id": str, "index": int, "custom_id": str}


def _tolerant_meta(raw: bytes | None) -> dict[str, Any]:
    """The meta's fields that can be read (so the batch counts the failure, and its result
    says which request it was)."""
    try:
        meta = serializer.loads(raw or b"{}")
    except Exception:
        return {}
    if not isinstance(meta, dict):
        return {}
    return {k: meta[k] for k, kind in _META_TYPES.items() if isinstance(meta.get(k), kind)}
