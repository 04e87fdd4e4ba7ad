"""Starting jobs with one server-side script each: what RQ's objects write when a worker
takes a job (RQ 3.0's execution, its registries, the job's fields) with the batch counter,
and the check that the job still waits for this worker, in one atomic step with no WATCH.

Through RQ's objects a job costs about 12 commands inside a WATCHed transaction, a round
trip first to check that every job still waits, and RQ's Python around them; a sweeper or
a cancel touching any job of the group meanwhile made the whole group start over. Here a
group is one transaction of one ``EVALSHA`` a job, and a job that stopped waiting is
simply not started.

What the script assumes, and what it does otherwise (a refused job is never dropped):
- the job's id is in its queue's intermediate list (``pull`` put it there) and its status is
  ``queued``: it starts, and leaves the list in the same step;
- the id is in no intermediate list: either a sweeper put it back (it is in its queue again,
  or another worker holds it: left alone), or it got out of every list by a path this module
  does not know (status still ``queued``, in neither list): pushed back on its queue;
- the status is not ``queued`` (cancelled, or ended or started by someone else): not
  started, and its id is dropped from the intermediate list (nothing there to recover);
- its batch is cancelled (``keys.batch_cancelled``, set in the cancel's first step, before
  any of its waiting jobs is cancelled): not started, and :func:`start_jobs` cancels it
  (``cancel_retry``: its ``cancelled`` result, out of every list) — so no job of a batch
  starts once its cancel is acknowledged, whichever list a worker took it from and
  whenever it took it. Jobs pushed onto RQ directly have no batch and no such check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import uuid4

import redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import current_timestamp, utcformat
from rq.worker import BaseWorker, WorkerStatus

from mlxq.broker import keys
from mlxq.broker.rq_store import cancel_retry
from mlxq.broker.rq_store.counters import batch_of, move_step_lua
from mlxq.broker.rq_store.rq_keys import execution_key, executions_key, job_key, started_key

# KEYS: 1 job hash, 2 the queue's intermediate list, 3 execution, 4 the job's executions,
# 5 started registry, 6 the worker's executions, 7 the job's stranded mark, 8 batch
# counters (or the job's hash again when it has no batch). ARGV: 1 job id, 2 execution id,
# 3 composite execution key, 4 created_at (a timestamp), 5 worker name, 6 heartbeat TTL,
# 7 score in the job's executions, 8 score in the started registry, 9 now (RQ's text),
# 10 "1" when counted in a batch. KEYS[9]: the job's queue; KEYS[10]: its batch's
# cancelled flag (``keys.batch_cancelled``; the job's hash again when it has no batch).
# Returns 1 (started) or a refusal code of ``REFUSED``.
_START = (
    """
local status = redis.call('HGET', KEYS[1], 'status')
local cancelled = ARGV[10] == '1' and redis.call('EXISTS', KEYS[10]) == 1
if not redis.call('LPOS', KEYS[2], ARGV[1]) then
  if status == 'queued' and cancelled then return -3 end
  if status == 'queued' and not redis.call('LPOS', KEYS[9], ARGV[1]) then
    redis.call('LPUSH', KEYS[9], ARGV[1])
    return -1
  end
  return 0
end
if status ~= 'queued' then
  redis.call('LREM', KEYS[2], 1, ARGV[1])
  redis.call('DEL', KEYS[7])
  return -2
end
if cancelled then return -3 end
local ttl = tonumber(ARGV[6])
redis.call('HSET', KEYS[3], 'id', ARGV[2], 'job_id', ARGV[1], 'created_at', ARGV[4],
           'last_heartbeat', ARGV[4], 'worker_name', ARGV[5])
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('ZADD', KEYS[4], ARGV[7], ARGV[2])
redis.call('EXPIRE', KEYS[4], ttl + 60)
redis.call('ZADD', KEYS[5], ARGV[8], ARGV[3])
if ARGV[5] ~= '' then
  redis.call('SADD', KEYS[6], ARGV[3])
  redis.call('EXPIRE', KEYS[6], ttl + 60)
end
"""
    + move_step_lua("KEYS[1]", "KEYS[8]", "'started'", when="ARGV[10] == '1'")
    + """
redis.call('HSET', KEYS[1], 'last_heartbeat', ARGV[9], 'status', 'started',
           'started_at', ARGV[9], 'worker_name', ARGV[5])
redis.call('PERSIST', KEYS[1])
redis.call('LREM', KEYS[2], 1, ARGV[1])
redis.call('DEL', KEYS[7])
return 1
"""
)


# Why a job was not started, by the script's code.
REFUSED = {
    0: "no longer waiting for this worker (a sweep put it back; it runs elsewhere)",
    -1: "was in no list when it came to start; put it back on its queue",
    -2: "no longer queued (cancelled, or ended elsewhere); not run",
    -3: "belongs to a cancelled batch; cancelled, not run",
}


def start_jobs(worker: BaseWorker, group: Sequence[tuple[Job, Queue]]) -> list[Execution | str]:
    """Register ``group`` as this worker's RQ executions (status ``started``) in one
    transaction, and mark the worker busy; per job its execution, or why it was not
    started (``REFUSED``: a job that stopped waiting for this worker)."""
    executions = [_execution(worker, job) for job, _ in group]
    with worker.connection.pipeline() as pipe:
        script = pipe.register_script(_START)
        for (job, queue), execution in zip(group, executions, strict=True):
            keys_, args = _call(worker, job, queue, execution)
            script(keys=keys_, args=args)
        worker.set_state(WorkerStatus.BUSY, pipeline=pipe)
        worker.heartbeat(worker.job_monitoring_interval + 60, pipeline=pipe)
        codes = [int(code) for code in pipe.execute()[: len(group)]]
    out: list[Execution | str] = []
    for (job, _), execution, code in zip(group, executions, codes, strict=True):
        if code == 1:
            _mark_started(job, worker.name, execution)
            worker.executions[execution.id] = execution
        out.append(execution if code == 1 else REFUSED[code])
    _cancel_refused([job for (job, _), code in zip(group, codes, strict=True) if code == -3])
    return out


def _cancel_refused(jobs: list[Job]) -> None:
    """End the jobs refused for their batch's cancel as ``cancelled`` (its cancel would
    too). Where Redis fails here they stay in the intermediate list, ``queued``: the sweep
    puts them back, and the next start refuses and cancels them."""
    if not jobs:
        return
    try:
        cancel_retry.cancel_loaded(jobs[0].connection, jobs, from_lanes=False, taken=True)
    except redis.RedisError:
        pass


def _execution(worker: BaseWorker, job: Job) -> Execution:
    """A new execution of ``job`` by ``worker`` (as ``Execution.create`` makes it)."""
    execution = Execution(uuid4().hex, job.id, worker.connection, worker_name=worker.name)
    execution._job = job
    return execution


def _call(
    worker: BaseWorker, job: Job, queue: Queue, execution: Execution
) -> tuple[list[str], list[Any]]:
    """The script's keys and arguments for one job (as RQ's ``Execution.create`` and
    ``Job.prepare_for_execution`` write them)."""
    ttl = worker.get_heartbeat_ttl(job)
    batch_id = batch_of(job)
    hash_key = job_key(job.id)
    stamp = current_timestamp()
    keys_ = [
        hash_key,
        queue.intermediate_queue_key,
        execution_key(job.id, execution.id),
        executions_key(job.id),
        started_key(queue.name),
        execution.worker_executions_key,
        keys.stranded(job.id),
        keys.batch_counts(batch_id) if batch_id else hash_key,
        queue.key,
        keys.batch_cancelled(batch_id) if batch_id else hash_key,
    ]
    args = [
        job.id,
        execution.id,
        execution.composite_key,
        execution.created_at.timestamp(),
        worker.name,
        ttl,
        stamp + ttl + 60,
        "+inf" if ttl == -1 else (ttl if ttl < 0 else stamp + ttl),
        utcformat(execution.created_at),
        "1" if batch_id else "0",
    ]
    return keys_, args


def _mark_started(job: Job, worker_name: str, execution: Execution) -> None:
    """The Python job as ``Job.prepare_for_execution`` leaves it."""
    job.worker_name = worker_name
    job.last_heartbeat = job.started_at = execution.created_at
    job._status = JobStatus.STARTED
