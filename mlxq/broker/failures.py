"""Why a batch's jobs failed: their error messages grouped, most common first.

Reads the batch's job states a chunk at a time and the results of the failed ones only,
so a big batch with a few failures costs one small read per job plus the failures'.
Messages that differ only in their numbers (token counts, sizes) are one reason; each
reason keeps one real message as its example.
"""

from __future__ import annotations

import re
from collections import Counter

import msgspec
import redis

from mlxq.broker import batches
from mlxq.broker.rq_store import reads
from mlxq.broker.rq_store.states import BUCKET_OF_STATUS
from mlxq.wire import Result

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_FAILED_BUCKETS = frozenset({"failed", "expired"})


class FailureReason(msgspec.Struct):
    """One reason jobs failed: an example message and how many failed jobs gave it."""

    message: str
    count: int


class FailureSummary(msgspec.Struct):
    """The top reasons among ``failed`` failed jobs (``others`` more fall outside them)."""

    failed: int
    reasons: list[FailureReason]
    others: int


def failure_reasons(conn: redis.Redis, batch_id: str, top: int = 3) -> FailureSummary:
    """The batch's failed jobs' error messages grouped, ``top`` most common first."""
    counts: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for ids in batches.iter_job_id_chunks(conn, batch_id):
        states = reads.job_states(conn, ids)
        failed = [j for j, s in zip(ids, states, strict=True) if _is_failed(s)]
        for result in reads.read_results(conn, failed) if failed else []:
            message = _message(result)
            key = _NUMBER.sub("#", message)
            counts[key] += 1
            examples.setdefault(key, message)
    ranked = counts.most_common()
    shown = [FailureReason(examples[k], n) for k, n in ranked[:top]]
    return FailureSummary(
        failed=sum(counts.values()), reasons=shown, others=sum(n for _k, n in ranked[top:])
    )


def _is_failed(state: str) -> bool:
    return BUCKET_OF_STATUS.get(state, "failed") in _FAILED_BUCKETS


def _message(result: Result | None) -> str:
    """A failed job's reason in one line: its error, else its finish reason."""
    if result is None:
        return "failed without a result"
    error = result.error or f"finish reason {result.finish_reason}"
    first = error.strip().splitlines()
    return first[0] if first else error
