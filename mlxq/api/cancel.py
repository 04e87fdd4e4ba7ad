"""Cancelling a batch's queued jobs through RQ.

Queued jobs are cancelled with RQ's own ``Job.cancel`` (status ``canceled``, out of the
queue, into the canceled registry), pipelined in chunks. Jobs a worker has started are
left to finish: cancelling them would throw away work that is nearly done.
"""

from __future__ import annotations

from typing import Any

import redis
from rq.exceptions import InvalidJobOperation
from rq.job import Job

from mlxq.broker import batches as q
from mlxq.broker.serializer import serializer

_QUEUED_STATES = frozenset({"queued", "deferred", "scheduled"})
_CHUNK = 500


def cancel_queued_jobs(conn: redis.Redis, mlxq_batch_id: str) -> int:
    """Cancel (through RQ) every job of the mlxq batch still waiting in its queue; return
    how many. Running jobs are left to finish."""
    job_ids = q.batch_job_ids(conn, mlxq_batch_id)
    states = q.job_states(conn, job_ids)
    waiting = [jid for jid, s in zip(job_ids, states, strict=True) if s in _QUEUED_STATES]
    cancelled = 0
    for start in range(0, len(waiting), _CHUNK):
        chunk = waiting[start : start + _CHUNK]
        jobs = Job.fetch_many(chunk, connection=conn, serializer=serializer)
        with conn.pipeline() as pipe:
            for job in jobs:
                cancelled += _cancel_one(job, pipe)
            pipe.execute()
    return cancelled


def _cancel_one(job: Job | None, pipe: Any) -> int:
    if job is None or job.get_status(refresh=False) not in _QUEUED_STATES:
        return 0  # gone, or a worker took it since
    try:
        job.cancel(pipeline=pipe)
    except InvalidJobOperation:
        return 0
    return 1
