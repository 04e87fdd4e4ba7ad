"""A batch's counters: moving a job from one to another in the transaction that changes its
state (once, however often the move is applied), and reading them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from rq.job import Job

from mlxq.broker import keys
from mlxq.broker.rq_store.rq_keys import job_key
from mlxq.broker.rq_store.states import BUCKETS

# A job with no ``mlxq_state`` yet is in ``queued`` (where submit counts it). Batches
# without counters (made before they were kept) are left alone. Each counter is also kept
# per queue (``finished@QUEUE``, by the job's ``origin``) where submit started them, so a
# batch that mixes models shows each model's progress.
SEP = "@"  # between a counter and its queue: ``finished@QUEUE``


def move_lua(job: str = "KEYS[1]", counts: str = "KEYS[2]", bucket: str = "ARGV[1]") -> str:
    """Lua that moves a job (its hash at ``job``) to ``bucket`` in the batch counters at
    ``counts`` (Lua expressions), once; it returns 1 if it moved the job, else 0."""
    return f"""
if redis.call('EXISTS', {job}) == 0 or redis.call('EXISTS', {counts}) == 0 then
  return 0
end
local old = redis.call('HGET', {job}, 'mlxq_state') or 'queued'
if old == {bucket} then return 0 end
redis.call('HINCRBY', {counts}, old, -1)
redis.call('HINCRBY', {counts}, {bucket}, 1)
redis.call('HSET', {job}, 'mlxq_state', {bucket})
local origin = redis.call('HGET', {job}, 'origin')
if origin and redis.call('HEXISTS', {counts}, 'queued{SEP}' .. origin) == 1 then
  redis.call('HINCRBY', {counts}, old .. '{SEP}' .. origin, -1)
  redis.call('HINCRBY', {counts}, {bucket} .. '{SEP}' .. origin, 1)
end
return 1
"""


_MOVE = move_lua()


def move_step_lua(job: str, counts: str, bucket: str, when: str) -> str:
    """:func:`move_lua` as one step of a longer script, run if the Lua expression ``when``
    holds (its early returns end the step, not the script)."""
    return (
        f"if {when} then\n  local function move()\n{move_lua(job, counts, bucket)}"
        "  end\n  move()\nend\n"
    )


_REHOME = f"""
if redis.call('HEXISTS', KEYS[1], 'queued{SEP}' .. ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'queued{SEP}' .. ARGV[1], -1)
  redis.call('HINCRBY', KEYS[1], 'queued{SEP}' .. ARGV[2], 1)
end
"""


def rehome(pipe: Any, batch_id: str, old: str, new: str) -> None:
    """Queue, in ``pipe``'s transaction, moving a queued job's per-queue counter from queue
    ``old`` to ``new`` (where the batch keeps them)."""
    script = pipe.register_script(_REHOME)
    script(keys=[keys.batch_counts(batch_id)], args=[old, new])


def batch_of(job: Job) -> str | None:
    """The mlxq batch a job belongs to (None for jobs pushed into RQ by other means)."""
    meta = job.meta if isinstance(job.meta, dict) else {}
    batch_id = meta.get("batch_id")
    return batch_id if isinstance(batch_id, str) else None


def move(pipe: Any, job_id: str, batch_id: str | None, bucket: str) -> None:
    """Queue, in ``pipe``'s transaction, moving the job to its batch's ``bucket`` counter."""
    if batch_id is None:
        return
    script = pipe.register_script(_MOVE)
    script(keys=[job_key(job_id), keys.batch_counts(batch_id)], args=[bucket])


def mark_submitted(
    pipe: Any, job_ids: Sequence[str], batch_id: str, queues: Sequence[str] = ()
) -> None:
    """Count freshly enqueued jobs as queued (their hashes need no field for that), and
    per queue where ``queues`` gives each job's."""
    pipe.hincrby(keys.batch_counts(batch_id), "queued", len(job_ids))
    for queue, n in Counter(queues).items():
        pipe.hincrby(keys.batch_counts(batch_id), f"queued{SEP}{queue}", n)
    pipe.expire(keys.batch_counts(batch_id), keys.BATCH_TTL)


def read_counts(raw: dict[bytes, bytes]) -> dict[str, int]:
    """A batch's counters from its hash (missing ones are 0)."""
    got = {k.decode(): int(v) for k, v in raw.items()}
    return {b: got.get(b, 0) for b in BUCKETS}


def read_queue_counts(raw: dict[bytes, bytes]) -> dict[str, dict[str, int]]:
    """A batch's counters per queue, for the queues submit counted (missing ones are 0)."""
    out: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        bucket, sep, queue = k.decode().partition(SEP)
        if sep and bucket in BUCKETS:
            out.setdefault(queue, dict.fromkeys(BUCKETS, 0))[bucket] = int(v)
    return out
