"""``POST /v1/batches``: a batch created from its input file, validated and submitted.

The input file is validated and its requests enqueued as one mlxq batch before the
request is answered (``in_progress``, or ``failed`` with per-line ``errors``); the batch's
lock is held meanwhile, so another process never takes a half-submitted batch for a dead
one. What follows (progress, cancel, expiry, finalizing) is :mod:`mlxq.api.batches`.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from mlxq.api import store
from mlxq.api.auth import Tenant, owner_of
from mlxq.api.batches import refresh
from mlxq.api.errors import bad_request
from mlxq.api.models import unserved_problem
from mlxq.api.objects import (
    COMPLETION_WINDOWS,
    Batch,
    BatchError,
    BatchErrors,
    BatchState,
    RequestCounts,
    new_batch_id,
    now,
)
from mlxq.api.validation import Validated, validate_input
from mlxq.broker import batches, keys, routing
from mlxq.formats.openai_output import ENDPOINTS, unsupported_endpoint


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
        raise bad_request(unsupported_endpoint(endpoint), param="endpoint")
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
    """Enqueue the requests as one mlxq batch on a queue whose workers serve the model (its
    own queue if none does yet), at ``priority``."""
    mlxq_id = batches.new_batch_id()
    queue = routing.batch_queue(model, routing.Fleet.read(conn))  # (where its workers listen)

    def prepare(state: BatchState) -> bool:
        state.mlxq_batch_id, state.queue = mlxq_id, queue
        state.batch.model = model
        state.batch.request_counts = RequestCounts(total=len(requests))
        return True

    # The mlxq batch id is recorded first, so a submit cut short can be cleaned up.
    store.update_batch(conn, batch_id, prepare)
    source = f"api:{batch_id}"
    batches.submit(
        conn, requests, queue=queue, batch_id=mlxq_id, source=source, model=model, priority=priority
    )

    def started(state: BatchState) -> bool:
        state.submitted = True
        if state.batch.status == "validating":  # else cancelled meanwhile: refresh cancels
            state.batch.status = "in_progress"
            state.batch.in_progress_at = now()
        return True

    store.update_batch(conn, batch_id, started)
