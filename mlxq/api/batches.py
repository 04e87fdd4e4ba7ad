"""A batch's lifecycle after it is created (:mod:`mlxq.api.batch_create`): follow
progress, cancel, expire, finalize.

Every read (:func:`refresh`, from ``GET`` and from the periodic sweep) derives
progress from the mlxq batch's counters and finalizes the batch (:mod:`mlxq.api.finalize`)
once nothing is left to run. Ending a batch early (a cancel, or its window passing) never
runs in a read: the cancel's first step, one script call, runs in ``POST .../cancel``
before it answers (from then on no worker starts one of its jobs, and running ones stop at
their next step); the rest (its waiting jobs cancelled, a chunk at a time) runs on a
thread of its own (:func:`end_in_background`), started by the cancel, and by a read or the
sweep only where that work is still owed and no thread of this process does it. Every
transition is a compare-and-set on the record, and every step of an early end is
idempotent, so any number of API processes can do this concurrently.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from mlxq.api import redis_keys as rk
from mlxq.api import store
from mlxq.api.auth import Tenant
from mlxq.api.errors import ApiError, bad_request
from mlxq.api.finalize import finalize
from mlxq.api.objects import (
    FINAL_STATUSES,
    BatchError,
    BatchErrors,
    BatchState,
    RequestCounts,
    now,
)
from mlxq.broker import batches
from mlxq.wire import BatchStatus

log = logging.getLogger("mlxq.api")

# How long past its window an ending batch waits for requests still marked running.
ENDING_GRACE_S = 3600
# A batch's progress is read from its jobs at most once per this many milliseconds per
# job (counting 50,000 jobs takes about half a second; a small batch is read every time).
_CHECK_MS_PER_JOB = 0.05
# After ending a batch's jobs early, how long its thread looks (every ``_SETTLE_POLL_S``)
# for the running ones to stop, to finalize the batch then; reads and the sweep finalize
# it after that.
_SETTLE_S = 30.0
_SETTLE_POLL_S = 0.2


# -- cancel -------------------------------------------------------------------------------


def cancel_batch(conn: redis.Redis, batch_id: str, tenant: Tenant | None) -> BatchState:
    """Mark ``tenant``'s batch ``cancelling`` (idempotent) and return it.

    Where its requests are enqueued, the mlxq batch is marked cancelled too, in one script
    call before this returns: no worker starts one of its jobs after it, and the running
    ones stop at their next step. The caller then starts :func:`end_in_background`, which
    cancels the jobs still waiting and finalizes the batch ``cancelled``, with what had
    finished in its output file and the rest in its error file as ``batch_cancelled``.
    """

    def cancelling(state: BatchState) -> bool:
        batch = state.batch
        if batch.status in ("cancelling", "cancelled"):
            return False
        if batch.status not in ("validating", "in_progress"):
            raise bad_request(f"Cannot cancel a batch with status {batch.status!r}.")
        batch.status = "cancelling"
        batch.cancelling_at = now()
        state.ending = "cancelled"
        return True

    store.get_batch(conn, batch_id, tenant)  # a 404 unless it is the tenant's
    state = store.update_batch(conn, batch_id, cancelling)
    if state.batch.status == "cancelling" and state.submitted and state.mlxq_batch_id:
        batches.mark_cancelled(conn, state.mlxq_batch_id)  # (a batch still validating: after it)
    return state


# Batches whose early end runs on a thread of this process (``end_in_background``).
_ending: set[str] = set()
_ending_lock = threading.Lock()


def end_in_background(conn: redis.Redis, batch_id: str) -> bool:
    """Start a thread that ends a cancelled or expiring batch's jobs (:func:`end_jobs`) and
    then finalizes it, unless one of this process does already; whether it started one.
    Never waits on Redis: the caller (a request, a read) answers at once."""
    with _ending_lock:
        if batch_id in _ending:
            return False
        _ending.add(batch_id)
    thread = threading.Thread(
        target=_end_quietly, args=(conn, batch_id), name=f"mlxq-end-{batch_id}", daemon=True
    )
    thread.start()
    return True


def _end_quietly(conn: redis.Redis, batch_id: str) -> None:
    """:func:`end_jobs`; a failure is logged, and the next read or sweep starts it again."""
    try:
        end_jobs(conn, batch_id)
    except Exception:
        log.exception("ending the jobs of batch %s failed", batch_id)
    finally:
        with _ending_lock:
            _ending.discard(batch_id)


def end_jobs(conn: redis.Redis, batch_id: str, settle_s: float = _SETTLE_S) -> BatchState:
    """End a cancelled (or expiring) batch's jobs, once: the mlxq batch marked cancelled
    (no worker starts its jobs; on a cancel its running ones stop, on expiry they finish)
    and its waiting jobs cancelled (``mlxq.broker.batches.cancel_batch``: idempotent, no
    transaction a worker's take can abort). Then, for up to ``settle_s`` seconds, refresh
    the batch until it is final (its running jobs stopped), and return its record."""
    state = store.get_batch(conn, batch_id)
    if state.batch.status in FINAL_STATUSES or not state.ending:
        return state
    if state.submitted and state.mlxq_batch_id:
        stop = state.ending == "cancelled"
        batches.cancel_batch(conn, state.mlxq_batch_id, stop_running=stop)
    deadline = time.monotonic() + settle_s
    while True:
        state = refresh(conn, batch_id, force=True, ender=True)
        if state.batch.status in FINAL_STATUSES or time.monotonic() >= deadline:
            return state
        time.sleep(_SETTLE_POLL_S)


# -- progress -----------------------------------------------------------------------------


def refresh(
    conn: redis.Redis, batch_id: str, *, force: bool = False, ender: bool = False
) -> BatchState:
    """The batch's record brought up to date: progress counts, expiry, and finalization
    when nothing is left to run. An ending batch whose jobs are still owed their early
    end gets it started on a thread (:func:`end_in_background`), never run here; while
    that thread runs (``ender``: the call is its own) it finalizes the batch, not a read.

    A large batch's jobs are counted at most every ``total * 0.05`` ms (by any process);
    in between, and unless ``force``, the stored record is returned as it is.
    """
    state = store.get_batch(conn, batch_id)
    status = state.batch.status
    if status in FINAL_STATUSES:
        return state
    if not state.submitted:  # validating, or cancelled while validating
        return _recover_validating(conn, state)
    if status == "finalizing":
        return finalize(conn, batch_id)
    if not force and not _check_due(conn, state):
        return state
    if status == "in_progress" and state.ending is None and now() >= (state.batch.expires_at or 0):
        state = store.update_batch(conn, batch_id, _expiring)
    assert state.mlxq_batch_id is not None
    try:
        progress = batches.batch_status(conn, state.mlxq_batch_id)
    except batches.BatchNotFound:
        return store.update_batch(conn, batch_id, _lost)
    if state.ending and _end_owed(conn, state.mlxq_batch_id, progress):
        end_in_background(conn, batch_id)  # (it answers at once: this read never waits)
    if _nothing_left(state, progress) and (ender or not _ends_here(batch_id)):
        return finalize(conn, batch_id)
    return store.update_batch(conn, batch_id, lambda s: _counts(s, progress))


def _ends_here(batch_id: str) -> bool:
    """Whether a thread of this process is ending the batch (and will finalize it)."""
    with _ending_lock:
        return batch_id in _ending


def _end_owed(conn: redis.Redis, mlxq_batch_id: str, p: BatchStatus) -> bool:
    """Whether an ending batch's early end still has work to do: jobs waiting, or the mlxq
    batch not marked cancelled yet (a process that died between the two)."""
    return p.queued > 0 or not batches.batch_cancelled(conn, mlxq_batch_id)


def _check_due(conn: redis.Redis, state: BatchState) -> bool:
    """Whether it is time to count the batch's jobs again (and claim that turn)."""
    ms = int(state.batch.request_counts.total * _CHECK_MS_PER_JOB)
    if ms < 10:
        return True
    return bool(conn.set(rk.batch_checked(state.batch.id), 1, px=ms, nx=True))


def _expiring(state: BatchState) -> bool:
    if state.batch.status != "in_progress" or state.ending is not None:
        return False
    state.ending = "expired"
    return True


def _nothing_left(state: BatchState, p: BatchStatus) -> bool:
    """Whether the batch can be finalized: every job done or, once it is ending early,
    none queued or running (or, an hour past its window, whatever still runs: a job whose
    worker died with no other worker to notice stays "started")."""
    if state.ending:
        overdue = now() > (state.batch.expires_at or 0) + ENDING_GRACE_S
        return p.queued == 0 and (p.started == 0 or overdue)
    return p.done + p.other >= p.total


def _counts(state: BatchState, p: BatchStatus) -> bool:
    counts = RequestCounts(total=p.total, completed=p.finished, failed=p.failed + p.cancelled)
    if (
        state.batch.status not in ("in_progress", "cancelling")
        or state.batch.request_counts == counts
    ):
        return False
    state.batch.request_counts = counts
    return True


def _lost(state: BatchState) -> bool:
    """The mlxq batch is gone from Redis (flushed, or kept past its TTL): fail the batch."""
    if state.batch.status not in ("in_progress", "cancelling"):
        return False
    message = "the batch's jobs are no longer in Redis (was it flushed?)"
    return _fail_now(state, BatchError("batch_lost", message))


def _fail_now(state: BatchState, error: BatchError) -> bool:
    state.batch.status = "failed"
    state.batch.failed_at = now()
    state.batch.errors = BatchErrors(data=[error])
    return True


def _recover_validating(conn: redis.Redis, state: BatchState) -> BatchState:
    """A batch left ``validating`` by a process that died: fail it and cancel what it had
    enqueued. While the validating process lives it holds the lock, and this does nothing."""
    batch_id = state.batch.id
    with store.batch_lock(conn, batch_id) as held:
        if not held:
            return state
        if state.mlxq_batch_id:
            _cancel_orphans(conn, state.mlxq_batch_id)
        return store.update_batch(conn, batch_id, _interrupted)


def _interrupted(state: BatchState) -> bool:
    if state.submitted or state.batch.status in FINAL_STATUSES:
        return False
    message = "validation was interrupted (the API process stopped); create the batch again"
    return _fail_now(state, BatchError("validation_interrupted", message))


def _cancel_orphans(conn: redis.Redis, mlxq_batch_id: str) -> None:
    """Stop what an interrupted validation had enqueued: marked cancelled here, in one step
    (none of its jobs starts), and its waiting jobs cancelled on a thread (a read never
    waits on that)."""
    try:
        batches.mark_cancelled(conn, mlxq_batch_id, stop_running=False)
    except redis.RedisError as e:  # best effort: the batch fails either way
        log.warning("could not cancel the jobs of interrupted batch %s: %s", mlxq_batch_id, e)
        return

    def cancel_rest() -> None:
        try:
            batches.cancel_batch(conn, mlxq_batch_id, stop_running=False)
        except Exception:
            log.exception("cancelling the jobs of interrupted batch %s failed", mlxq_batch_id)

    threading.Thread(target=cancel_rest, name=f"mlxq-orphans-{mlxq_batch_id}", daemon=True).start()


def sweep(conn: redis.Redis) -> int:
    """Refresh every active batch (progress, expiry, finalization); return how many."""
    done = 0
    for batch_id in store.active_batch_ids(conn):
        try:
            refresh(conn, batch_id)
            done += 1
        except ApiError:  # its record expired: forget it
            conn.srem(rk.active_batches(), batch_id)
        except redis.ConnectionError:
            raise  # Redis is down: the next sweep tries again
        except Exception:  # one bad batch does not stop the others
            log.exception("refreshing batch %s failed", batch_id)
    return done
