"""A batch's lifecycle: validate and submit, follow progress, cancel, expire, finalize.

``POST /v1/batches`` validates the input file and enqueues its requests as one mlxq batch
before answering (``in_progress``, or ``failed`` with per-line ``errors``); the batch's
lock is held meanwhile, so another process never takes a half-submitted batch for a dead
one. From then on nothing runs in the background that the batch depends on: every read
(:func:`refresh`, from ``GET`` and from the periodic sweep) derives progress from the mlxq
batch's job states, cancels what must be cancelled, and finalizes the batch
(:mod:`mlxq.api.finalize`) once nothing is left to run. Every transition is a
compare-and-set on the record, so any number of API processes can do this concurrently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis

from mlxq.api import redis_keys as rk
from mlxq.api import store
from mlxq.api.auth import Tenant, owner_of
from mlxq.api.errors import ApiError, bad_request
from mlxq.api.finalize import finalize
from mlxq.api.models import unserved_problem
from mlxq.api.objects import (
    COMPLETION_WINDOWS,
    FINAL_STATUSES,
    Batch,
    BatchError,
    BatchErrors,
    BatchState,
    RequestCounts,
    new_batch_id,
    now,
)
from mlxq.api.validation import Validated, validate_input
from mlxq.broker import batches as q
from mlxq.broker import keys
from mlxq.formats.openai_input import CHAT_URL, COMPLETIONS_URL
from mlxq.formats.openai_output import ENDPOINTS
from mlxq.wire import BatchStatus

log = logging.getLogger("mlxq.api")

# How long past its window an ending batch waits for requests still marked running.
ENDING_GRACE_S = 3600
# A batch's progress is read from its jobs at most once per this many milliseconds per
# job (counting 50,000 jobs takes about half a second; a small batch is read every time).
_CHECK_MS_PER_JOB = 0.05


# -- create -------------------------------------------------------------------------------


def create_batch(
    conn: redis.Redis,
    *,
    tenant: Tenant | None,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    max_lines: int,
    allow_unserved: bool = False,
    expected_models: Sequence[str] = (),
) -> BatchState:
    """Validate ``tenant``'s input file and submit its requests as ``tenant``'s batch; the
    record says how that went. Unless ``allow_unserved``, a batch for a model that no
    worker serves, has served lately, or is expected (``expected_models``) fails validation
    (it would wait for a worker nobody starts)."""
    _check_params(endpoint, completion_window, metadata)
    file = store.get_file(conn, input_file_id, tenant)
    if file.purpose != "batch":
        raise bad_request(
            f"File {input_file_id} has purpose {file.purpose!r}; a batch needs a file "
            "uploaded with purpose 'batch'",
            param="input_file_id",
        )
    content = store.get_file_content(conn, input_file_id, tenant)
    created = now()
    batch = Batch(
        id=new_batch_id(),
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=completion_window,
        status="validating",
        created_at=created,
        expires_at=created + COMPLETION_WINDOWS[completion_window],
        metadata=metadata,
    )
    with store.batch_lock(conn, batch.id):  # a fresh id: always free
        store.create_batch(conn, BatchState(batch=batch, owner=owner_of(tenant)))
        validated = validate_input(content, endpoint, max_lines=max_lines)
        if not validated.errors and not allow_unserved:
            validated.errors = _unserved_errors(conn, validated, expected_models)
        if validated.errors:
            return store.update_batch(conn, batch.id, lambda s: _fail(s, validated.errors))
        priority = (metadata or {}).get("priority", keys.DEFAULT_PRIORITY)
        _submit(conn, batch.id, validated.requests, validated.model, priority)
    return refresh(conn, batch.id, force=True)  # after the lock: it may finalize


def _unserved_errors(
    conn: redis.Redis, validated: Validated, expected: Sequence[str]
) -> list[BatchError]:
    """OpenAI's ``model_not_found`` line error for each model no worker serves (live, lately
    or ``expected``), on the first line naming it (lines naming none go to the batch's
    model's queue)."""
    errors = []
    for model, line in validated.model_lines.items():
        if model is None and validated.model is not None:
            continue  # on the batch's model's queue: checked with its lines
        problem = unserved_problem(conn, model, expected)
        if problem is not None:
            param = "body.model" if model is not None else None
            errors.append(BatchError("model_not_found", problem, param=param, line=line))
    return errors


def _check_params(endpoint: str, window: str, metadata: dict[str, str] | None) -> None:
    if endpoint not in ENDPOINTS:
        raise bad_request(
            f"Unsupported endpoint {endpoint!r}: mlxq serves {CHAT_URL} and {COMPLETIONS_URL}",
            param="endpoint",
        )
    if window not in COMPLETION_WINDOWS:
        raise bad_request(
            f"Invalid completion_window {window!r}: supported: {', '.join(COMPLETION_WINDOWS)}",
            param="completion_window",
        )
    if metadata is None:
        return
    if len(metadata) > 16:
        raise bad_request("metadata: at most 16 key-value pairs", param="metadata")
    for k, v in metadata.items():
        if len(k) > 64 or len(v) > 512:
            raise bad_request(
                f"metadata: keys are at most 64 characters and values at most 512 ({k[:64]!r})",
                param="metadata",
            )
    # mlxq reads one key: the batch's priority (workers take higher priorities first)
    if metadata.get("priority", keys.DEFAULT_PRIORITY) not in keys.PRIORITIES:
        raise bad_request(
            f"metadata.priority: {metadata['priority']!r} is not one of "
            f"{', '.join(keys.PRIORITIES)}",
            param="metadata",
        )


def _fail(state: BatchState, errors: list[BatchError]) -> bool:
    if state.batch.status not in ("validating", "cancelling"):
        return False
    state.batch.status = "failed"
    state.batch.failed_at = now()
    state.batch.errors = BatchErrors(data=errors)
    return True


def _submit(
    conn: redis.Redis, batch_id: str, requests: list, model: str | None, priority: str
) -> None:
    """Enqueue the requests as one mlxq batch on the model's queue, at ``priority``."""
    mlxq_id = q.new_batch_id()
    queue = keys.queue_name_for_model(model)

    def prepare(state: BatchState) -> bool:
        state.mlxq_batch_id, state.queue = mlxq_id, queue
        state.batch.model = model
        state.batch.request_counts = RequestCounts(total=len(requests))
        return True

    # The mlxq batch id is recorded first, so a submit cut short can be cleaned up.
    store.update_batch(conn, batch_id, prepare)
    source = f"api:{batch_id}"
    q.submit(
        conn, requests, queue=queue, batch_id=mlxq_id, source=source, model=model, priority=priority
    )

    def started(state: BatchState) -> bool:
        state.submitted = True
        if state.batch.status == "validating":  # else cancelled meanwhile: refresh cancels
            state.batch.status = "in_progress"
            state.batch.in_progress_at = now()
        return True

    store.update_batch(conn, batch_id, started)


# -- cancel -------------------------------------------------------------------------------


def cancel_batch(conn: redis.Redis, batch_id: str, tenant: Tenant | None) -> BatchState:
    """Mark ``tenant``'s batch ``cancelling`` (idempotent) and return it.

    The next :func:`refresh` (the app runs one right after answering; GETs and the sweep
    run more) cancels its queued requests, lets running ones finish, and makes the batch
    ``cancelled``, with what did run in its output file, once nothing runs.
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
    return store.update_batch(conn, batch_id, cancelling)


# -- progress -----------------------------------------------------------------------------


def refresh(conn: redis.Redis, batch_id: str, *, force: bool = False) -> BatchState:
    """The batch's record brought up to date: progress counts, expiry, cancellation of
    queued jobs, and finalization when nothing is left to run.

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
        if state.ending:
            q.cancel_batch(conn, state.mlxq_batch_id, stop_running=False)
        progress = q.batch_status(conn, state.mlxq_batch_id)
    except q.BatchNotFound:
        return store.update_batch(conn, batch_id, _lost)
    if _nothing_left(state, progress):
        return finalize(conn, batch_id)
    return store.update_batch(conn, batch_id, lambda s: _counts(s, progress))


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
    try:
        q.cancel_batch(conn, mlxq_batch_id, stop_running=False)
    except redis.RedisError as e:  # best effort: the batch fails either way
        log.warning("could not cancel the jobs of interrupted batch %s: %s", mlxq_batch_id, e)


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
