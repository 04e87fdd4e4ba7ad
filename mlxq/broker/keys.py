"""Redis key names and the defaults every part of mlxq agrees on.

Jobs themselves live under RQ's own keys, which only ``mlxq.broker.rq_store`` names;
mlxq adds the batch records, worker records, streams and flags below.
"""

from __future__ import annotations

import os

PREFIX = "mlxq"

# The function name every mlxq RQ job carries; a worker refuses any other.
JOB_FUNC = "mlxq.jobs.generate"

DEFAULT_QUEUE = "default"
# Results are kept for a week: batch users collect them hours or days later,
# not within RQ's 500 s default.
DEFAULT_RESULT_TTL = 7 * 24 * 3600
# Wall-clock limit of one generation job (RQ's job timeout), in seconds.
DEFAULT_JOB_TIMEOUT = 3600
# Batch records outlive their results a little, so a late `mlxq results` still lists them.
BATCH_TTL = DEFAULT_RESULT_TTL + 24 * 3600

# The largest job payload (inflated) a worker reads: 8x the CLI's and the API's 1 MiB line
# limit. RQ inflates payloads with no bound (0.78 MB of zlib can become gigabytes).
MAX_JOB_BYTES = 8 * 1024 * 1024

# Batch priorities, highest first: a worker takes a higher one's jobs before any lower one's.
PRIORITIES = ("high", "normal", "low")
DEFAULT_PRIORITY = "normal"

ENV_REDIS_URL = "MLXQ_REDIS_URL"


def redis_url_from_env() -> str | None:
    """The Redis URL configured in the environment, or None for the embedded server."""
    return os.environ.get(ENV_REDIS_URL) or None


def batch_info(batch_id: str) -> str:
    """JSON ``BatchInfo`` of one batch (a string key)."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_jobs(batch_id: str) -> str:
    """List of the batch's RQ job ids, in input order."""
    return f"{PREFIX}:batch:{batch_id}:jobs"


def batch_counts(batch_id: str) -> str:
    """Hash of the batch's job counts by state (queued, started, finished, failed,
    cancelled, expired), updated in the same transaction as each job's state."""
    return f"{PREFIX}:batch:{batch_id}:counts"


def batch_submitter(batch_id: str) -> str:
    """Held (with a short expiry, refreshed per chunk) while a submit enqueues the batch."""
    return f"{PREFIX}:batch:{batch_id}:submitting"


def batch_lanes(batch_id: str) -> str:
    """Set of the queues on which the batch has a lane (``lane``)."""
    return f"{PREFIX}:batch:{batch_id}:lanes"


def lane(queue: str, batch_id: str) -> str:
    """List of the batch's job ids waiting on ``queue``, in input order: workers share a
    queue between its batches a job at a time (``rq_store.lanes``)."""
    return f"{PREFIX}:batch:{batch_id}:lane:{queue}"


def lanes(queue: str, priority: str) -> str:
    """List of the lanes (their keys) of ``queue`` at ``priority``, in round-robin order."""
    return f"{PREFIX}:lanes:{priority}:{queue}"


def batches() -> str:
    """Sorted set of batch ids scored by creation time."""
    return f"{PREFIX}:batches"


def worker_info(name: str) -> str:
    """JSON ``WorkerInfo`` of a live worker (expires a little after its last heartbeat)."""
    return f"{PREFIX}:worker:{name}"


def models_seen() -> str:
    """Hash of every model a worker has served: model -> JSON ``SeenModel`` (its queues
    and when last seen), so that work for a fleet asleep right now is still accepted."""
    return f"{PREFIX}:models:seen"


# How long a model counts as served after its last worker was seen (a fleet of laptops
# may all be asleep over a weekend).
SEEN_FOR_S = 7 * 24 * 3600


def lane_turns() -> str:
    """Hash: each lane's key -> the turn at which a pull last took from it, and ``#`` -> the
    last turn given (one count over every queue, so turns compare across queues)."""
    return f"{PREFIX}:lane-turns"


def starting_workers(host: str) -> str:
    """Hash of the workers of ``host`` that claimed their memory and are loading: pid ->
    JSON (name, pid, memory fraction); see ``mlxq.worker.sharing``."""
    return f"{PREFIX}:starting:{host}"


def workers() -> str:
    """Set of worker names that have published info (stale names are pruned on read)."""
    return f"{PREFIX}:workers"


def stream(job_id: str) -> str:
    """Redis stream of a ``stream: true`` job's output: entries with a ``data`` field
    holding a JSON ``StreamEntry``; the last one has ``finish_reason``."""
    return f"{PREFIX}:stream:{job_id}"


def stranded(job_id: str) -> str:
    """When a sweeper first saw this job stranded, unregistered, in an intermediate queue."""
    return f"{PREFIX}:stranded:{job_id}"


def unaccounted(queue: str) -> str:
    """Hash of the queue's jobs a sweep saw waiting or running while no list or registry held
    them: job id -> when first seen so (dropped whole once nothing is unaccounted)."""
    return f"{PREFIX}:unaccounted:{queue}"


def audit_lock() -> str:
    """Held by the one worker that looks for unaccounted jobs, for one sweep interval."""
    return f"{PREFIX}:audit"


def cancel_flag(job_id: str) -> str:
    """Set by ``mlxq cancel`` for a running job; its worker stops it at the next step."""
    return f"{PREFIX}:cancel:{job_id}"


def queue_name_for_model(model: str | None) -> str:
    """The default queue of a model: its last path component (a GGUF file's without
    ``.gguf``), or ``default``."""
    if not model:
        return DEFAULT_QUEUE
    name = model.rstrip("/").rsplit("/", 1)[-1]
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return name or DEFAULT_QUEUE


def batch_cancelled(batch_id: str) -> str:
    """Set (``stop`` or ``drain``) the moment a batch is cancelled, kept ``BATCH_TTL``: no
    worker starts a job of the batch after it (the start script refuses them), and with
    ``stop`` running ones stop at their worker's next check (``drain``: they finish)."""
    return f"{PREFIX}:batch:{batch_id}:cancelled"
