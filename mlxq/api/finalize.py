"""Finalizing a batch: its results become an output file and an error file, once.

Finalization runs under the batch's Redis lock (``SET NX PX``), so of several API processes
that see a batch done at the same moment, one builds the files and the others answer with
the record as it stands. The record moves ``in_progress``/``cancelling`` → ``finalizing``
→ ``completed``/``cancelled``/``expired`` through compare-and-set writes. The files'
ids are derived from the batch id, so if a holder dies half way its lock expires and the
next attempt rewrites the same files rather than leaving orphans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from mlxq.api import redis_keys as rk
from mlxq.api import store
from mlxq.api.objects import (
    BatchState,
    BatchUsage,
    RequestCounts,
    encoder,
    now,
    output_file_id,
)
from mlxq.broker import batches
from mlxq.broker.rq_store import reads
from mlxq.formats.openai_output import (
    ERROR_MESSAGES,
    error_line,
    is_success,
    request_line_id,
    to_openai_line,
)
from mlxq.wire import Result

_INCOMPLETE = "The request had not completed when the batch was finalized."


@dataclass
class Outcome:
    """What finalization produced: file ids (None when a file would be empty) and totals."""

    output_file_id: str | None = None
    error_file_id: str | None = None
    counts: RequestCounts = field(default_factory=RequestCounts)
    usage: BatchUsage = field(default_factory=BatchUsage)


def finalize(conn: redis.Redis, batch_id: str) -> BatchState:
    """Build the batch's files and move it to its final state, unless another process is
    doing so; return the record as it then stands."""
    with store.batch_lock(conn, batch_id) as held:
        if not held:
            return store.get_batch(conn, batch_id)
        state = store.update_batch(conn, batch_id, _to_finalizing)
        if state.batch.status != "finalizing":
            return state
        if state.ending:  # a job put back by a stopping worker since the last look
            batches.cancel_batch(conn, state.mlxq_batch_id or "", stop_running=False)
        outcome = build_files(conn, state)
        return store.update_batch(conn, batch_id, lambda s: _to_final(s, outcome))


def _to_finalizing(state: BatchState) -> bool:
    batch = state.batch
    if batch.status not in ("in_progress", "cancelling"):
        return False  # already finalizing (a previous holder died), or final
    batch.status = "finalizing"
    batch.finalizing_at = now()
    return True


def _to_final(state: BatchState, outcome: Outcome) -> bool:
    batch = state.batch
    if batch.status != "finalizing":
        return False
    t = now()
    if state.ending == "cancelled":
        batch.status, batch.cancelled_at = "cancelled", t
    elif state.ending == "expired":
        batch.status, batch.expired_at = "expired", t
    else:
        batch.status, batch.completed_at = "completed", t
    batch.output_file_id = outcome.output_file_id
    batch.error_file_id = outcome.error_file_id
    batch.request_counts = outcome.counts
    batch.usage = outcome.usage
    return True


def build_files(conn: redis.Redis, state: BatchState) -> Outcome:
    """Write the output and error files of a batch from its mlxq results."""
    assert state.mlxq_batch_id is not None
    batch = state.batch
    job_ids = batches.batch_job_ids(conn, state.mlxq_batch_id)
    results = batches.fetch_results(conn, job_ids)
    missing = [jid for jid, r in zip(job_ids, results, strict=True) if r is None]
    metas = reads.job_metas(conn, missing)
    custom_ids = {jid: m.custom_id for jid, m in zip(missing, metas, strict=True)}
    stopped_code = "batch_expired" if state.ending == "expired" else "batch_cancelled"
    outcome = Outcome(counts=RequestCounts(total=len(job_ids)))
    output: list[bytes] = []
    errors: list[bytes] = []
    for jid, result in zip(job_ids, results, strict=True):
        if result is None:
            code = stopped_code if state.ending else "request_incomplete"
            message = ERROR_MESSAGES.get(code, _INCOMPLETE)
            line = error_line(request_line_id(jid), custom_ids[jid], code, message)
            errors.append(encoder.encode(line))
            continue
        _add_usage(outcome.usage, result)
        line = to_openai_line(result, batch.endpoint, cancelled_code=stopped_code)
        (output if is_success(result) else errors).append(encoder.encode(line))
    outcome.counts.completed, outcome.counts.failed = len(output), len(errors)
    outcome.output_file_id = _write(conn, state, "output", output)
    outcome.error_file_id = _write(conn, state, "error", errors)
    return outcome


def _write(conn: redis.Redis, state: BatchState, kind: Any, lines: list[bytes]) -> str | None:
    """The batch's output or error file, owned by the batch's tenant."""
    if not lines:
        return None
    batch_id = state.batch.id
    record = store.put_file(
        conn,
        b"\n".join(lines) + b"\n",
        filename=f"{batch_id}_{kind}.jsonl",
        purpose="batch_output",
        owner=state.owner,
        file_id=output_file_id(batch_id, kind),
        ttl=rk.RECORD_TTL,
    )
    return record.id


def _add_usage(usage: BatchUsage, result: Result) -> None:
    usage.input_tokens += result.usage.prompt_tokens
    usage.output_tokens += result.usage.completion_tokens
    usage.total_tokens += result.usage.total_tokens
