"""Redis keys of the HTTP API, all under ``mlxq:api:``.

Files and batch records of the OpenAI-compatible API live here; the jobs a batch runs are
ordinary mlxq batches (``mlxq.broker.keys``), whose id the batch record keeps.
"""

from __future__ import annotations

from mlxq.broker import keys

PREFIX = f"{keys.PREFIX}:api"

# Batch records and the files a batch produces are kept 30 days, as OpenAI keeps output files.
RECORD_TTL = 30 * 24 * 3600
# A lock held while one API process validates or finalizes a batch; long enough for 50,000
# requests, short enough that a crashed holder does not stall the batch for long.
LOCK_TTL = 15 * 60


def file_record(file_id: str) -> str:
    """JSON ``FileObject`` of an uploaded or produced file (a string key)."""
    return f"{PREFIX}:file:{file_id}"


def file_content(file_id: str) -> str:
    """The file's bytes (a string key)."""
    return f"{PREFIX}:file:{file_id}:content"


def file_owner(file_id: str) -> str:
    """The tenant that owns the file (see ``mlxq.api.auth.Tenant``; absent: no tenant)."""
    return f"{PREFIX}:file:{file_id}:owner"


def files() -> str:
    """Sorted set of every file id scored by creation time (for ``GET /v1/files``). It never
    expires, as input files do not; ids whose record expired are pruned as listings meet them."""
    return f"{PREFIX}:files"


def owner_files(owner: str) -> str:
    """Sorted set of one tenant's file ids scored by creation time."""
    return f"{PREFIX}:owner:{owner}:files"


def batch_record(batch_id: str) -> str:
    """JSON ``BatchState`` of a batch: the OpenAI object plus what mlxq needs to run it."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_lock(batch_id: str) -> str:
    """Held (``SET NX PX``) by the process validating or finalizing the batch."""
    return f"{PREFIX}:batch:{batch_id}:lock"


def batch_checked(batch_id: str) -> str:
    """Set (``SET NX PX``) when a batch's progress is read from its jobs, so that many
    pollers of a large batch do not each count all its jobs."""
    return f"{PREFIX}:batch:{batch_id}:checked"


def batches() -> str:
    """Sorted set of batch ids scored by creation time (for ``GET /v1/batches``)."""
    return f"{PREFIX}:batches"


def owner_batches(owner: str) -> str:
    """Sorted set of one tenant's batch ids scored by creation time."""
    return f"{PREFIX}:owner:{owner}:batches"


def active_batches() -> str:
    """Set of batch ids not in a final state yet (what the background sweep refreshes)."""
    return f"{PREFIX}:active"
