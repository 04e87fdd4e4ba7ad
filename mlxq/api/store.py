"""Files and batch records of the API, kept in Redis (keys in :mod:`mlxq.api.redis_keys`).

A file is two string keys: its JSON ``FileObject`` and its bytes, indexed by creation time
for listing. A batch is one JSON ``BatchState``, indexed by creation time for listing and,
until it reaches a final state, in a set of active batches. Every change to a batch record
is a compare-and-set (``WATCH``/``MULTI``), so API processes sharing the Redis never
overwrite each other's transitions.

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
from dataclasses import dataclass
from typing import Generic, TypeVar

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
        for index in _file_indexes(owner):
            # Scored by the exact time, so files made in the same second keep their order.
            pipe.zadd(index, {record.id: time.time()})
        pipe.execute()
    return record


def _file_indexes(owner: str | None) -> list[str]:
    return [rk.files()] + ([rk.owner_files(owner)] if owner else [])


def get_file(conn: redis.Redis, file_id: str, tenant: Tenant | None) -> FileObject:
    """A file's record, or a 404 ``ApiError`` (also for another tenant's file)."""
    return file_decoder.decode(_file_part(conn, file_id, tenant, rk.file_record))


def get_file_content(conn: redis.Redis, file_id: str, tenant: Tenant | None) -> bytes:
    """A file's bytes, or a 404 ``ApiError`` (also for another tenant's file)."""
    return _file_part(conn, file_id, tenant, rk.file_content)


def delete_file(conn: redis.Redis, file_id: str, tenant: Tenant | None) -> None:
    """Delete a file, or raise a 404 ``ApiError`` if there is none (for this tenant)."""
    _file_part(conn, file_id, tenant, rk.file_record)
    owner = conn.get(rk.file_owner(file_id))
    keys = (rk.file_record(file_id), rk.file_content(file_id), rk.file_owner(file_id))
    with conn.pipeline() as pipe:
        pipe.delete(*keys)
        for index in _file_indexes(owner.decode() if owner else None):
            pipe.zrem(index, file_id)
        deleted = pipe.execute()[0]
    if not deleted:
        raise not_found("File", file_id)


def list_files(
    conn: redis.Redis,
    *,
    tenant: Tenant | None,
    purpose: str | None,
    after: str | None,
    limit: int,
    desc: bool,
) -> tuple[list[FileObject], bool]:
    """Up to ``limit`` of the files ``tenant`` sees (of ``purpose``, if given), newest first
    if ``desc``, after the file ``after``; and whether more follow."""
    return _page(
        conn,
        Listing("File", rk.files(), rk.owner_files, rk.file_record, file_decoder.decode),
        tenant,
        after=after,
        limit=limit,
        desc=desc,
        keep=(lambda f: f.purpose == purpose) if purpose else None,
    )


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
    listing = Listing(
        "Batch", rk.batches(), rk.owner_batches, rk.batch_record, state_decoder.decode
    )
    return _page(conn, listing, tenant, after=after, limit=limit, desc=True)


# -- listing ------------------------------------------------------------------------------

T = TypeVar("T")

# Records read per round trip while listing (a filter may skip most of them).
_LIST_CHUNK = 1000


@dataclass(frozen=True)
class Listing(Generic[T]):
    """What a listing reads: its objects' kind (for errors), the index of everyone's ids
    and of one owner's, the key of an id's record and the record's decoder."""

    kind: str
    everyone: str
    owner_index: Callable[[str], str]
    record_key: Callable[[str], str]
    decode: Callable[[bytes], T]

    def index(self, tenant: Tenant | None) -> str:
        """The index ``tenant`` lists: its own, or everyone's for admins and no-auth."""
        return self.everyone if tenant is None or tenant.admin else self.owner_index(tenant.owner)


def _page(
    conn: redis.Redis,
    listing: Listing[T],
    tenant: Tenant | None,
    *,
    after: str | None,
    limit: int,
    desc: bool,
    keep: Callable[[T], bool] | None = None,
) -> tuple[list[T], bool]:
    """Up to ``limit`` records of the ids ``tenant`` sees (by score, descending if ``desc``)
    that come after ``after`` and that ``keep`` keeps; and whether more follow. Ids whose
    record expired are skipped and removed from the indexes."""
    index = listing.index(tenant)
    start = 0
    if after:
        rank = conn.zrevrank(index, after) if desc else conn.zrank(index, after)
        if rank is None:
            raise bad_request(f"No such {listing.kind} object: {after}", param="after")
        start = rank + 1
    read = conn.zrevrange if desc else conn.zrange
    found: list[T] = []
    while len(found) <= limit:
        want = min(limit + 1 - len(found), _LIST_CHUNK) if keep is None else _LIST_CHUNK
        ids = [i.decode() for i in read(index, start, start + want - 1)]
        if not ids:
            break
        raws = conn.mget([listing.record_key(i) for i in ids])
        gone = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
        if gone:
            conn.zrem(index, *gone)
            conn.zrem(listing.everyone, *gone)
        start += len(ids) - len(gone)  # the ranks after them moved up by as many
        records = (listing.decode(raw) for raw in raws if raw is not None)
        found.extend(r for r in records if keep is None or keep(r))
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
