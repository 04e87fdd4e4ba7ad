"""What an operator asks of a batch's jobs: cancel them (each job that had not started
stores a ``cancelled`` result), retry the failed ones.

A batch's cancel is two steps, and neither is a transaction that a worker's take can
abort and send round again:

1. :func:`mark_cancelled`, one server-side script: the batch's cancelled flag
   (``keys.batch_cancelled``), its record's state ``cancelled`` and its lanes dropped,
   together. From that step on no worker starts a job of the batch: a take finds no lane,
   and the start script (``start_script``) refuses a job it took before or from RQ's
   list; with ``stop`` the jobs running stop at their worker's next check (the worker
   reads the flag: ``watchdog.stop_due``).
2. :func:`cancel_now`: every job still waiting (on RQ's list, or taken by a worker that
   has not started it) ends ``cancelled``, a chunk of jobs per round trip, one script per
   job that checks the job's status in the step that ends it. A job started meanwhile is
   left to its worker (and the flag); a job already ended is left as it is; run twice, or
   by two cancellers at once, each job is cancelled once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import redis
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result as RQResult
from rq.utils import now, utcformat

from mlxq.broker import keys
from mlxq.broker.rq_store import lanes
from mlxq.broker.rq_store.counters import batch_of, move, move_step_lua
from mlxq.broker.rq_store.internals import enqueue_again
from mlxq.broker.rq_store.reads import chunks, job_states
from mlxq.broker.rq_store.rq_keys import job_key, registry_score, results_key
from mlxq.broker.rq_store.states import WAITING
from mlxq.broker.rq_store.transitions import result_without_output
from mlxq.broker.serializer import serializer
from mlxq.wire import BatchInfo, json_encoder

# A batch's cancel: ``stop`` stops its running jobs too, ``drain`` lets them finish.
STOP, DRAIN = "stop", "drain"

# KEYS: 1 the batch's cancelled flag, 2 its record, then ``lanes.drop_keys``'s. ARGV: 1 the
# flag (``stop`` or ``drain``), 2 its TTL, 3 the record as read ('' to leave it), 4 the
# record to write in its place, then the lanes' queues. The flag is set, or raised from
# ``drain`` to ``stop`` (never lowered); the record is written only if unchanged since it
# was read. Returns {1 if the record is as the caller wants it (else read it again),
# how many lanes the batch still has that the caller did not name}.
_MARK = (
    """
local flag = redis.call('GET', KEYS[1])
if flag ~= 'stop' and flag ~= ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
end
local written = 1
if ARGV[3] ~= '' then
  local raw = redis.call('GET', KEYS[2])
  if raw == ARGV[3] then
    redis.call('SET', KEYS[2], ARGV[4], 'KEEPTTL')
  elseif raw then
    written = 0
  end
end
"""
    + lanes.drop_lua(3, 5)
    + """
return {written, lanes_left}
"""
)

# KEYS: 1 job hash, 2 its queue's RQ list, 3 the queue's intermediate list, 4 its batch's
# lane on the queue, 5 the queue's canceled registry, 6 the job's results, 7 batch counters
# (or the job's hash again when it has no batch), 8 the job's stranded mark, 9 deferred
# and 10 scheduled registries, 11 dependents, 12 dependencies. ARGV: 1 job id, 2 ended_at
# (RQ's text), 3 result TTL, 4 score in the canceled registry, 5 "1" when counted in a
# batch, 6 "1" to take the id out of its lane, 7 "1" out of the intermediate list, 8.. the
# result entry's fields. Returns 1 (cancelled), 2 (running: left to its worker) or 0
# (ended, or gone). An id left in an intermediate list (a worker took it and will start it)
# leaves it when that start finds it cancelled, or by the sweep of stranded ids.
_CANCEL = (
    """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'started' then return 2 end
if status ~= 'queued' and status ~= 'deferred' and status ~= 'scheduled'
   and status ~= 'created' then
  return 0
end
redis.call('LREM', KEYS[2], 0, ARGV[1])
if ARGV[7] == '1' then redis.call('LREM', KEYS[3], 0, ARGV[1]) end
if ARGV[6] == '1' then redis.call('LREM', KEYS[4], 0, ARGV[1]) end
redis.call('ZREM', KEYS[9], ARGV[1])
redis.call('ZREM', KEYS[10], ARGV[1])
redis.call('DEL', KEYS[8])
"""
    + move_step_lua("KEYS[1]", "KEYS[7]", "'cancelled'", when="ARGV[5] == '1'")
    + """
redis.call('HSET', KEYS[1], 'status', 'canceled', 'ended_at', ARGV[2])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', 10, '*', unpack(ARGV, 8))
local ttl = tonumber(ARGV[3])
redis.call('ZADD', KEYS[5], ARGV[4], ARGV[1])
if ttl == -1 then
  redis.call('PERSIST', KEYS[6])
elseif ttl == 0 then
  redis.call('DEL', KEYS[1], KEYS[6], KEYS[11], KEYS[12])
else
  redis.call('EXPIRE', KEYS[6], ttl)
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[11], ttl)
  redis.call('EXPIRE', KEYS[12], ttl)
end
return 1
"""
)

_info_decoder = msgspec.json.Decoder(BatchInfo)

# A submit writes a batch's record at most twice more: no cancel needs more tries than this.
MARK_TRIES = 20

# Jobs read and ended per round trip (``cancel_now``).
CANCEL_CHUNK = 500


def mark_cancelled(conn: redis.Redis, batch_id: str, mode: str = STOP) -> None:
    """Step 1 of a batch's cancel (the module docstring): its flag, its record's state
    ``cancelled`` and its lanes dropped, in one atomic step. Idempotent; a ``drain`` after
    a ``stop`` leaves it ``stop``.

    The step is taken again (at once: nothing here waits on a worker) only where a submit
    wrote meanwhile: its last chunk's lanes, or its record ``submitted``. A submit's chunk
    watches the record, so once the record says ``cancelled`` none is written."""
    if mode not in (STOP, DRAIN):
        raise ValueError(f"mode: {mode!r} is not {STOP!r} or {DRAIN!r}")
    script = conn.register_script(_MARK)
    for _ in range(MARK_TRIES):
        raw = conn.get(keys.batch_info(batch_id))
        old = new = b""
        if raw is not None:
            info = _info_decoder.decode(raw)
            if info.state != "cancelled":
                old = raw
                new = json_encoder.encode(msgspec.structs.replace(info, state="cancelled"))
        lane_keys, queues = lanes.drop_keys(conn, batch_id)
        keys_ = [keys.batch_cancelled(batch_id), keys.batch_info(batch_id), *lane_keys]
        args = [mode, keys.BATCH_TTL, old, new, *queues]
        written, left = script(keys=keys_, args=args)
        if written and not left:
            return
    raise RuntimeError(
        f"batch {batch_id}: its record or lanes changed under {MARK_TRIES} cancels in a row "
        "(it is flagged cancelled all the same: no worker starts its jobs); run it again"
    )


def cancel_now(
    conn: redis.Redis, job_ids: Sequence[str], from_lanes: bool = True
) -> tuple[int, int]:
    """Step 2 of a batch's cancel, or the cancel of single jobs: every job among ``job_ids``
    still waiting ends ``cancelled`` (out of RQ's list, with a ``cancelled`` result and its
    batch counter; a worker that took it refuses to start it), ``CANCEL_CHUNK`` jobs per
    round trip, one script each. Returns (how many it cancelled, how many it found
    running).

    ``from_lanes``: each id also leaves its batch's lane (a scan of the lane; a whole
    batch's cancel has dropped its lanes already and passes False)."""
    cancelled = running = 0
    for chunk in chunks(job_ids, CANCEL_CHUNK):
        states = job_states(conn, chunk)
        running += sum(s == JobStatus.STARTED.value for s in states)
        waiting = [jid for jid, s in zip(chunk, states, strict=True) if s in WAITING]
        if waiting:
            jobs = Job.fetch_many(waiting, connection=conn, serializer=serializer)
            c, r = cancel_loaded(conn, [j for j in jobs if j is not None], from_lanes)
            cancelled, running = cancelled + c, running + r
    return cancelled, running


def cancel_loaded(
    conn: redis.Redis, jobs: Sequence[Job], from_lanes: bool = True, taken: bool = False
) -> tuple[int, int]:
    """:func:`cancel_now` for jobs already read, in one round trip; (cancelled, found
    started meanwhile). ``taken``: the jobs were taken into their queue's intermediate list
    (a worker's start refused them: their batch is cancelled) and leave it too."""
    if not jobs:
        return 0, 0
    with conn.pipeline(transaction=False) as pipe:
        script = pipe.register_script(_CANCEL)
        for job in jobs:
            keys_, args = _cancel_call(job, from_lanes, taken)
            script(keys=keys_, args=args)
        codes = [int(c) for c in pipe.execute()]
    return codes.count(1), codes.count(2)


def _cancel_call(job: Job, from_lanes: bool, taken: bool) -> tuple[list[str], list[Any]]:
    """The cancel script's keys and arguments for one job (what ``transitions.end_job``
    writes for a cancelled job, and RQ's ``Job.cancel``)."""
    queue = Queue(job.origin, connection=job.connection, serializer=serializer)
    batch_id = batch_of(job)
    hash_key = job_key(job.id)
    ttl = job.get_result_ttl(keys.DEFAULT_RESULT_TTL)
    ended = now()
    result = result_without_output(job, "cancelled", "cancelled before it started")
    entry = RQResult(
        job.id,
        RQResult.Type.SUCCESSFUL,
        job.connection,
        return_value=msgspec.to_builtins(result),
        serializer=serializer,
        execution_ended_at=ended,
    ).serialize()
    keys_ = [
        hash_key,
        queue.key,
        queue.intermediate_queue_key,
        keys.lane(job.origin, batch_id) if batch_id else hash_key,
        queue.canceled_job_registry.key,
        results_key(job.id),
        keys.batch_counts(batch_id) if batch_id else hash_key,
        keys.stranded(job.id),
        queue.deferred_job_registry.key,
        queue.scheduled_job_registry.key,
        job.dependents_key,
        job.dependencies_key,
    ]
    args = [
        job.id,
        utcformat(ended),
        ttl,
        registry_score(ttl),
        "1" if batch_id else "0",
        "1" if from_lanes and batch_id else "0",
        "1" if taken else "0",
        *[x for kv in entry.items() for x in kv],
    ]
    return keys_, args


def flag_running(conn: redis.Redis, job_ids: Sequence[str]) -> int:
    """Flag the running jobs among ``job_ids`` to stop at their worker's next check
    (``keys.cancel_flag``); returns how many. A flag lasts as long as its job can still run
    (its time limit, and a minute), so none outlives its job."""
    with conn.pipeline(transaction=False) as pipe:
        for jid in job_ids:
            pipe.hmget(job_key(jid), "status", "timeout")
        found = pipe.execute()
    running = 0
    with conn.pipeline(transaction=False) as pipe:
        for jid, (status, limit) in zip(job_ids, found, strict=True):
            if status != JobStatus.STARTED.value.encode():
                continue
            runs_for = int(float(limit)) if limit else keys.DEFAULT_JOB_TIMEOUT
            pipe.set(keys.cancel_flag(jid), 1, ex=max(runs_for, 0) + 60)
            running += 1
        pipe.execute()
    return running


def retry_failed(conn: redis.Redis, job_ids: Sequence[str]) -> int:
    """Put the failed jobs among ``job_ids`` back on their queues; returns how many."""
    count = 0
    for jid, state in zip(job_ids, job_states(conn, job_ids), strict=True):
        if state == "failed" and _retry_one(conn, jid):
            count += 1
    return count


def _retry_one(conn: redis.Redis, job_id: str) -> bool:
    with conn.pipeline() as pipe:
        try:
            pipe.watch(job_key(job_id))
            job = Job.fetch(job_id, connection=conn, serializer=serializer)
            if job.get_status(refresh=False) != JobStatus.FAILED:
                return False
            queue = Queue(job.origin, connection=conn, serializer=serializer)
            job.started_at = job.ended_at = None
            pipe.multi()
            pipe.zrem(job.failed_job_registry.key, job.id)
            move(pipe, job.id, batch_of(job), "queued")
            enqueue_again(queue, job, pipe, at_front=False)
            pipe.execute()
            return True
        except redis.WatchError:
            return False  # changed meanwhile (retried by someone else)
