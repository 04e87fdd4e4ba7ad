"""RQ's job states as mlxq reads them, and the batch counter a job is in for each."""

from __future__ import annotations

from rq.job import JobStatus

# RQ's statuses, grouped as mlxq reads them. ``created`` is a job RQ made but has not
# queued yet; it never ran, so it is cancelled like a queued one.
WAITING = frozenset({"queued", "deferred", "scheduled", "created"})
RUNNING = frozenset({"started"})
ENDED = frozenset({"finished", "failed", "stopped", "canceled"})
GONE = "expired"  # the job's hash is no longer in Redis
# A batch's counters; every job is in exactly one.
BUCKETS = ("queued", "started", "finished", "failed", "cancelled", "expired")
# The counter of a job in each RQ status (for batches counted job by job).
BUCKET_OF_STATUS = {
    **dict.fromkeys(WAITING, "queued"),
    "started": "started",
    "finished": "finished",
    "failed": "failed",
    "stopped": "failed",
    "canceled": "cancelled",
    GONE: "expired",
}
# The RQ status and the counter a job ends in, by its result's finish reason.
STATUS_OF_REASON = {
    "stop": JobStatus.FINISHED,
    "length": JobStatus.FINISHED,
    "cancelled": JobStatus.CANCELED,
    "error": JobStatus.FAILED,
    "timeout": JobStatus.FAILED,
    "expired": JobStatus.FAILED,
}
BUCKET_OF_REASON = {
    "stop": "finished",
    "length": "finished",
    "cancelled": "cancelled",
    "error": "failed",
    "timeout": "failed",
    "expired": "expired",
}
