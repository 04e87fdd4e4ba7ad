"""Workers sharing one machine's memory: a worker starting where live workers already run
sizes its memory from what they leave (their ``WorkerInfo`` in Redis says what they hold),
or refuses to start.

A worker publishes its ``WorkerInfo`` only once its model has loaded, so a worker claims
its share before loading (:func:`claim_start`): it records its ``--memory-fraction`` for
its host, then reads the other claims. Of two workers started at the same moment, each
writes before it reads, so the later reader sees the earlier claim whatever the timing, and
the two never take more than the machine's share together. A starting worker's device is
not known yet (it is read on the MLX thread), so its claim counts against every memory
domain of its host until its record, which names its domain, replaces it.

All the live workers of a host and memory domain (:attr:`DeviceFacts.memory_domain`)
together stay under ``max(--memory-fraction, its default)`` of the memory; a worker never
takes more than its own ``--memory-fraction``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import msgspec
import redis

from mlxq.broker import fleet, keys
from mlxq.engine.hardware import DeviceFacts
from mlxq.wire import WorkerInfo
from mlxq.worker.profile import DEFAULTS


class Starting(msgspec.Struct):
    """A worker of this host that claimed its share and is loading its model."""

    name: str
    pid: int
    fraction: float  # its --memory-fraction


@dataclass(frozen=True)
class Share:
    """What this worker may hold of its memory, and why."""

    limit_bytes: int  # weights + caches of this worker
    ceiling_bytes: int  # what every mlxq worker on this memory may hold together
    others: tuple[WorkerInfo, ...] = ()  # the live workers on the same memory
    starting: tuple[tuple[Starting, int], ...] = ()  # workers still loading, with bytes

    @property
    def crowded(self) -> bool:
        """Whether other workers hold (or are about to hold) some of this memory."""
        return bool(self.others or self.starting)

    @property
    def others_bytes(self) -> int:
        """What the other workers hold, or claimed while they load."""
        return sum(claimed(w) for w in self.others) + sum(b for _, b in self.starting)

    def describe(self) -> str:
        """The decision in words (for the log and for a refusal)."""
        held = [(w.name, w.pid, "", claimed(w)) for w in self.others]
        held += [(s.name, s.pid, ", starting", b) for s, b in self.starting]
        names = ", ".join(f"{n} (pid {pid}{how}): {b / 2**30:.1f} GiB" for n, pid, how, b in held)
        return (
            f"{len(held)} live worker(s) on this host's memory ({names}) hold "
            f"{self.others_bytes / 2**30:.1f} of the {self.ceiling_bytes / 2**30:.1f} GiB "
            "that mlxq workers may use there"
        )


def claimed(w: WorkerInfo) -> int:
    """What a worker holds; a worker of an older version publishes only its KV budget."""
    return w.memory_claimed_bytes or w.kv_budget_bytes


def neighbours(conn: redis.Redis) -> list[WorkerInfo]:
    """The live workers of this host (their process still running), as Redis lists them."""
    host = socket.gethostname()
    return [w for w in fleet.live_workers(conn) if w.host == host and _running(w.pid)]


def claim_start(conn: redis.Redis, name: str, fraction: float) -> list[Starting]:
    """Record that this process, about to load its model, takes ``fraction`` of its host's
    memory; then the claims of the other workers of this host still loading (those whose
    record is published count by it: :func:`neighbours`). Claims of ended processes are
    dropped."""
    key = keys.starting_workers(socket.gethostname())
    me = Starting(name, os.getpid(), fraction)
    with conn.pipeline() as pipe:  # written before the others are read: see the docstring
        pipe.hset(key, str(me.pid), msgspec.json.encode(me))
        pipe.expire(key, keys.BATCH_TTL)
        pipe.hgetall(key)
        raw = pipe.execute()[-1]
    published = {w.pid for w in neighbours(conn)}
    out, ended = [], []
    for field, value in raw.items():
        try:
            claim = _starting.decode(value)
        except msgspec.DecodeError:
            continue
        if not _running(claim.pid):
            ended.append(field)
        elif claim.pid != me.pid and claim.pid not in published:
            out.append(claim)
    if ended:
        conn.hdel(key, *ended)
    return out


_starting = msgspec.json.Decoder(Starting)


def share(
    facts: DeviceFacts,
    fraction: float,
    workers: list[WorkerInfo],
    starting: list[Starting] | tuple[Starting, ...] = (),
) -> Share:
    """What a worker asking for ``fraction`` of ``facts``' memory may hold beside
    ``workers`` (this host's live workers, :func:`neighbours`) and the workers of this host
    still loading (``starting``, :func:`claim_start`)."""
    memory = facts.recommended_bytes
    own = int(memory * fraction)
    others = tuple(w for w in workers if w.memory_domain == facts.memory_domain)
    loading = tuple((s, int(memory * s.fraction)) for s in starting)
    if not others and not loading:
        return Share(own, own)
    ceiling = int(memory * max(fraction, DEFAULTS.memory_fraction))
    left = ceiling - sum(claimed(w) for w in others) - sum(b for _, b in loading)
    return Share(max(0, min(own, left)), ceiling, others, loading)


def _running(pid: int) -> bool:
    """Whether a process of this host runs as ``pid`` (a crashed worker's record lingers
    until it expires)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
