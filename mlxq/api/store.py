"""Files and batch records of the API, kept in Redis (keys in :mod:`mlxq.api.redis_keys`).

A file is two string keys: its JSON ``FileObject`` and its bytes. A batch is one JSON
``BatchState``, indexed by creation time for listing and, until it reaches a final state,
in a set of active batches. Every change to a batch record is a compare-and-set
(``WATCH``/``MULTI``), so API processes sharing the Redis never overwrite each other's
transitions.

Each file and batch records the tenant that made it (``owner``); the reads that take a
``tenant`` answer 404 for another tenant's objects, as for objects that do not exist. An
id is only ever made of letters, digits, ``-`` and ``_``: anything else is no object's id
(``file-x:content`` must not name the key of file-x's content).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
from redis.exceptions import LockError, WatchError

from mlxq.api import redis_keys as rk
from mlxq.api.auth import Tenant, sees
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

_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _checked_id(kind: str, object_id: str) -> str:
    """``object_id`` if it can be an id (else a 404 like any unknown id)."""
    if not _ID.fullmatch(object_id):
        raise not_found(kind, object_id)
    return object_id


# -- files --------------------------------------------------------------------------------


def put_file(
    conn: redis.Redis,
    content: bytes,
    *,
    filename: str,
    purpose: str,
    owner: str | None,
    file_id: str | None = None,
    ttl: int | None = None,
) -> FileObject:
    """Store a file of tenant ``owner`` and return its record; with ``ttl`` (seconds) it
    expires, and says so."""
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
        if owner is not None:
            pipe.set(rk.file_owner(record.id), owner, ex=ttl)
        pipe.execute()
    return record


def get_file(conn: redis.Redis, file_id: str, tenant: Tenant | None) -> FileObject:
    """A file's record, or a 404 ``ApiError`` (also for another tenant's file)."""
    return file_decoder.decode(_file_part(conn, file_id, tenant, rk.file_record))


def get_file_content(conn: redis.Redis, file_id: str, tenant: Tenant | None) -> bytes:
    """A file's bytes, or a 404 ``ApiError`` (also for another tenant's file)."""
    return _file_part(conn, file_id, tenant, rk.file_content)


def delete_file(conn: redis.Redis, file_id: str, tenant: Tenant | None) -> None:
    """Delete a file, or raise a 404 ``ApiError`` if there is none (for this tenant)."""
    _file_part(conn, file_id, tenant, rk.file_record)
    keys = (rk.file_record(file_id), rk.file_content(file_id), rk.file_owner(file_id))
    if not conn.delete(*keys):
        raise not_found("File", file_id)


def _file_part(
    conn: redis.Redis, file_id: str, tenant: Tenant | None, key: Callable[[str], str]
) -> bytes:
    """The value at ``key(file_id)`` if the file exists and ``tenant`` may see it."""
    raw, owner = conn.mget(key(_checked_id("File", file_id)), rk.file_owner(file_id))
    if raw is None or not sees(tenant, owner.decode() if owner else None):
        raise not_found("File", file_id)
    return raw


# -- batches ------------------------------------------------------------------------------


def create_batch(conn: redis.Redis, state: BatchState) -> None:
    """Store a new batch record, index it, and mark it active."""
    batch = state.batch
    indexes = [rk.batches()] + ([rk.owner_batches(state.owner)] if state.owner else [])
    with conn.pipeline() as pipe:
        pipe.set(rk.batch_record(batch.id), encoder.encode(state), ex=rk.RECORD_TTL)
        for index in indexes:
            # Scored by the exact time, so batches made in the same second keep their order.
            pipe.zadd(index, {batch.id: time.time()})
            # Records expire RECORD_TTL after creation: drop their index entries too.
            pipe.zremrangebyscore(index, "-inf", f"({batch.created_at - rk.RECORD_TTL}")
            pipe.expire(index, rk.RECORD_TTL)
        if batch.status not in FINAL_STATUSES:
            pipe.sadd(rk.active_batches(), batch.id)
        pipe.execute()


def get_batch(conn: redis.Redis, batch_id: str, tenant: Tenant | None = None) -> BatchState:
    """A batch's record, or a 404 ``ApiError`` (also for another tenant's batch; without
    ``tenant``, for the server's own bookkeeping, every batch is found)."""
    raw = conn.get(rk.batch_record(_checked_id("Batch", batch_id)))
    state = state_decoder.decode(raw) if raw is not None else None
    if state is None or not sees(tenant, state.owner):
        raise not_found("Batch", batch_id)
    return state


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
    conn: redis.Redis, *, tenant: Tenant | None, after: str | None, limit: int
) -> tuple[list[BatchState], bool]:
    """Up to ``limit`` of the batches ``tenant`` sees, newest first, after the batch
    ``after``; and whether more follow."""
    own = tenant is not None and not tenant.admin
    index = rk.owner_batches(tenant.owner) if tenant is not None and own else rk.batches()
    start = 0
    if after:
        rank = conn.zrevrank(index, after)
        if rank is None:
            raise bad_request(f"No such Batch object: {after}", param="after")
        start = rank + 1
    found: list[BatchState] = []
    while len(found) <= limit:
        want = limit + 1 - len(found)
        ids = [i.decode() for i in conn.zrevrange(index, start, start + want - 1)]
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
