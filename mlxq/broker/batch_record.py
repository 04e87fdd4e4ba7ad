"""A batch's record in Redis: its id, its stored ``BatchInfo`` and its job ids in input
order. Both submitting (``submission``) and reading a batch back (``batches``) start here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import msgspec
import redis

from mlxq.broker import keys
from mlxq.broker.rq_store import reads
from mlxq.wire import BatchInfo

CHUNK = reads.CHUNK  # ids read (and jobs written) per round trip

decode_info = msgspec.json.Decoder(BatchInfo).decode


class BatchNotFound(LookupError):
    """No batch with this id in Redis (never submitted, or expired)."""


def new_batch_id() -> str:
    """A short, unique, URL-safe batch id."""
    return "b" + uuid.uuid4().hex[:16]


def get_batch(conn: redis.Redis, batch_id: str) -> BatchInfo:
    """The stored record of a batch, or ``BatchNotFound``."""
    raw = conn.get(keys.batch_info(batch_id))
    if raw is None:
        raise BatchNotFound(
            f"no batch {batch_id!r} on this Redis (check the id and --redis-url; "
            f"batches expire {keys.BATCH_TTL // 86400} days after submit)"
        )
    return decode_info(raw)


def batch_job_ids(conn: redis.Redis, batch_id: str) -> list[str]:
    """The batch's job ids in input order."""
    return [j for ids in iter_job_id_chunks(conn, batch_id) for j in ids]


def iter_job_id_chunks(conn: redis.Redis, batch_id: str) -> Iterator[list[str]]:
    """The batch's job ids in input order, a chunk at a time (bounded memory)."""
    start = 0
    while True:
        ids = [j.decode() for j in conn.lrange(keys.batch_jobs(batch_id), start, start + CHUNK - 1)]
        if ids:
            yield ids
        if len(ids) < CHUNK:
            return
        start += len(ids)
