"""Files and batch records of the API, kept in Redis (keys in :mod:`mlxq.api.redis_keys`).

A file is two string keys: its JSON ``FileObject`` and its bytes. A batch is one JSON
``BatchState``, indexed by creation time for listing and, until it reaches a final state,
in a set of active batches. Every change to a batch record is a compare-and-set
(``WATCH``/``MULTI``), so API processes sharing the Redis never overwrite each other's
transitions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
from redis.exceptions import LockError, WatchError

from mlxq.api import redis_keys as rk
from mlxq.api.errors import bad_request, not_found
from mlxq.api.objects import (
    FINAL_STATUSES,
    BatchState,
    FileObject,
    encoder,
    file_decoder,
    new_file_id,
    now,
    state_decoder,
)

# -- files --------------------------------------------------------------------------------


def put_file(
    conn: redis.Redis,
    content: bytes,
    *,
    filename: str,
    purpose: str,
    file_id: str | None = None,
    ttl: int | None = None,
) -> FileObject:
    """Store a file and return its record; with ``ttl`` (seconds) it expires, and says so."""
    created = now()
    record = FileObject(
        id=file_id or new_file_id(),
        bytes=len(content),
        created_at=created,
        filename=filename,
        purpose=purpose,
        expires_at=created + ttl if ttl else None,
    )
    with conn.pipeline() as pipe:
        pipe.set(rk.file_content(record.id), content, ex=ttl)
        pipe.set(rk.file_record(record.id), encoder.encode(record), ex=ttl)
        pipe.execute()
    return record


def get_file(conn: redis.Redis, file_id: str) -> FileObject:
    """A file's record, or a 404 ``ApiError``."""
    raw = conn.get(rk.file_record(file_id))
    if raw is None:
        raise not_found("File", file_id)
    return file_decoder.decode(raw)


def get_file_content(conn: redis.Redis, file_id: str) -> bytes:
    """A file's bytes, or a 404 ``ApiError``."""
    content = conn.get(rk.file_content(file_id))
    if content is None:
        raise not_found("File", file_id)
    return content


def delete_file(conn: redis.Redis, file_id: str) -> None:
    """Delete a file, or raise a 404 ``ApiError`` if there is none."""
    if not conn.delete(rk.file_record(file_id), rk.file_content(file_id)):
        raise not_found("File", file_id)


# -- batches ------------------------------------------------------------------------------


def create_batch(conn: redis.Redis, state: BatchState) -> None:
    """Store a new batch record, index it, and mark it active."""
    batch = state.batch
    with conn.pipeline() as pipe:
        pipe.set(rk.batch_record(batch.id), encoder.encode(state), ex=rk.RECORD_TTL)
        # Scored by the exact time, so batches created in the same second keep their order.
        pipe.zadd(rk.batches(), {batch.id: time.time()})
        # Records expire RECORD_TTL after creation: drop their index entries too.
        pipe.zremrangebyscore(rk.batches(), "-inf", f"({batch.created_at - rk.RECORD_TTL}")
        if batch.status not in FINAL_STATUSES:
            pipe.sadd(rk.active_batches(), batch.id)
        pipe.execute()


def get_batch(conn: redis.Redis, batch_id: str) -> BatchState:
    """A batch's record, or a 404 ``ApiError``."""
    raw = conn.get(rk.batch_record(batch_id))
    if raw is None:
        raise not_found("Batch", batch_id)
    return state_decoder.decode(raw)


def update_batch(
    conn: redis.Redis, batch_id: str, change: Callable[[BatchState], bool]
) -> BatchState:
    """Apply ``change`` to the stored record atomically and return the record.

    ``change`` edits the state it is given in place and returns True, or returns False
    (having changed nothing) when the transition does not apply to the current state. If
    another process writes the record in between, ``change`` runs again on the new one.
    """
    key = rk.batch_record(batch_id)
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                raw = pipe.get(key)
                if raw is None:
                    raise not_found("Batch", batch_id)
                state = state_decoder.decode(raw)
                if not change(state):
                    pipe.unwatch()
                    return state
                pipe.multi()
                pipe.set(key, encoder.encode(state), keepttl=True)
                if state.batch.status in FINAL_STATUSES:
                    pipe.srem(rk.active_batches(), batch_id)
                pipe.execute()
                return state
            except WatchError:
                continue


def list_batches(
    conn: redis.Redis, *, after: str | None, limit: int
) -> tuple[list[BatchState], bool]:
    """Up to ``limit`` batches, newest first, after the batch ``after``; and whether more
    follow."""
    start = 0
    if after:
        rank = conn.zrevrank(rk.batches(), after)
        if rank is None:
            raise bad_request(f"No such Batch object: {after}", param="after")
        start = rank + 1
    found: list[BatchState] = []
    while len(found) <= limit:
        want = limit + 1 - len(found)
        ids = [i.decode() for i in conn.zrevrange(rk.batches(), start, start + want - 1)]
        if not ids:
            break
        start += len(ids)
        raws = conn.mget([rk.batch_record(i) for i in ids])
        found.extend(state_decoder.decode(raw) for raw in raws if raw is not None)
    return found[:limit], len(found) > limit


def active_batch_ids(conn: redis.Redis) -> list[str]:
    """Ids of the batches not in a final state."""
    return [i.decode() for i in conn.smembers(rk.active_batches())]


@contextmanager
def batch_lock(conn: redis.Redis, batch_id: str) -> Iterator[bool]:
    """Try to take the batch's lock without waiting; yields whether this process holds it.

    The lock expires after ``LOCK_TTL`` seconds, so a holder that dies does not keep the
    batch from being finalized for long.
    """
    lock = conn.lock(rk.batch_lock(batch_id), timeout=rk.LOCK_TTL, blocking=False)
    held = lock.acquire()
    try:
        yield held
    finally:
        if held:
            try:
                lock.release()
            except LockError:  # expired and perhaps taken by another: nothing to release
                pass
