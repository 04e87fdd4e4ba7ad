"""RQ's key names, spelled only here: a job's hash, results and executions, a queue's list
and registries."""

from __future__ import annotations

from rq.defaults import RQ_KEY_PREFIX
from rq.job import Job
from rq.queue import Queue
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.results import Result as RQResult
from rq.utils import current_timestamp

QUEUES_SET = Queue.redis_queues_keys  # every queue ever enqueued to


def job_key(job_id: str) -> str:
    """The job's hash (status, meta, payload, timestamps)."""
    return Job.key_for(job_id)


def queue_key(name: str) -> str:
    """The list of job ids waiting in a queue."""
    return Queue.redis_queue_namespace_prefix + name


def queue_name_of(key: str) -> str | None:
    """The queue name of a key from ``QUEUES_SET``, or None for anything else."""
    prefix = Queue.redis_queue_namespace_prefix
    return key[len(prefix) :] if key.startswith(prefix) else None


def results_key(job_id: str) -> str:
    """The stream of the job's RQ results (the latest is the one that counts)."""
    return RQResult.get_key(job_id)


def execution_key(job_id: str, execution_id: str) -> str:
    """One execution (a worker's run) of a job."""
    return f"{RQ_KEY_PREFIX}:execution:{job_id}:{execution_id}"


def executions_key(job_id: str) -> str:
    """The sorted set of a job's executions."""
    return f"{RQ_KEY_PREFIX}:executions:{job_id}"


def intermediate_first_seen_key(queue: Queue, job_id: str) -> str:
    """RQ's mark of when its own cleanup first saw a job in the intermediate queue (it fails
    the job if it sees it again a minute later)."""
    return queue.intermediate_queue.get_first_seen_key(job_id)


def registry_keys(queue: str) -> tuple[str, str, str]:
    """(started, finished, failed) registry keys of a queue."""
    return started_key(queue), finished_key(queue), failed_key(queue)


def started_key(queue: str) -> str:
    """A queue's started-job registry (execution composite keys scored by expiry)."""
    return StartedJobRegistry.key_template.format(queue)


def failed_key(queue: str) -> str:
    """A queue's failed-job registry (a sorted set scored by expiry)."""
    return FailedJobRegistry.key_template.format(queue)


def finished_key(queue: str) -> str:
    """A queue's finished-job registry (a sorted set scored by expiry)."""
    return FinishedJobRegistry.key_template.format(queue)


def registry_score(ttl: int) -> float | str:
    """A registry entry's score for ``ttl`` seconds, as RQ's ``BaseRegistry.add`` sets it
    (a negative ttl: never expires)."""
    return "+inf" if ttl < 0 else current_timestamp() + ttl
