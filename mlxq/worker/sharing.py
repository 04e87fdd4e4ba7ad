"""Workers sharing one machine's memory: a worker starting where live workers already run
sizes its memory from what they leave (their ``WorkerInfo`` in Redis says what they hold),
or refuses to start.

A worker publishes its ``WorkerInfo`` only once its model has loaded, so a worker claims
its share before loading (:func:`claim_start`): it takes a ticket in its host's order of
claims, in the same step as it records its claim, and waits for the workers that claimed
before it to load and publish what they really hold. Of two workers started at the same
moment, one goes first and the other sizes itself from what the first holds, whatever the
timing; neither takes what the other holds. A worker that waits past ``WAIT_FOR_PEERS_S``
counts the ones still loading by their ``--memory-fraction``, against every memory domain
of its host (their device is not known yet).

All the live workers of a host and memory domain (:attr:`DeviceFacts.memory_domain`)
together stay under ``max(--memory-fraction, its default)`` of the memory; a worker never
takes more than its own ``--memory-fraction``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import redis

from mlxq.broker import fleet, keys
from mlxq.engine.hardware import DeviceFacts
from mlxq.wire import WorkerInfo
from mlxq.worker.profile import DEFAULTS

log = logging.getLogger("mlxq.worker")

# How long a starting worker waits for the workers of its host that claimed before it to
# load (a large model from disk: a minute or two); after that it counts their claims whole.
WAIT_FOR_PEERS_S = 300.0
WAIT_POLL_S = 0.5


class Starting(msgspec.Struct):
    """A worker of this host that claimed its share and is loading its model."""

    name: str
    pid: int
    fraction: float  # its --memory-fraction
    ticket: int = 0  # its place in the host's order of claims
    claimed_bytes: int = 0  # what it holds once loaded (0: still loading)


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
    return [w for w in fleet.live_workers(conn) if w.host == host and process_running(w.pid)]


# Takes a ticket and records the claim in one step, so a worker that reads the claims after
# it has both. KEYS: the host's hash. ARGV: pid, the claim's JSON. Returns the ticket.
_CLAIM = """
local ticket = redis.call('HINCRBY', KEYS[1], '#', 1)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], 't:' .. ARGV[1], ticket)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return ticket
"""


def claim_start(
    conn: redis.Redis, name: str, fraction: float, wait_s: float = WAIT_FOR_PEERS_S
) -> list[Starting]:
    """Record that this process, about to load its model, takes ``fraction`` of its host's
    memory, and wait (up to ``wait_s``) for the workers of this host that claimed before it
    to load (:func:`claim_loaded`). The claims of this host's other workers that hold
    memory without a published record (a frozen worker's expired): loaded ones count what
    they hold, earlier ones still loading after the wait their whole fraction, later ones
    still loading nothing (they wait for this one)."""
    key = keys.starting_workers(socket.gethostname())
    pid = os.getpid()
    me = Starting(name, pid, fraction)
    claim = conn.register_script(_CLAIM)
    ticket = int(claim(keys=[key], args=[pid, msgspec.json.encode(me), keys.BATCH_TTL]))
    deadline = time.monotonic() + wait_s
    while True:
        claims = _unpublished(conn, key)
        earlier = [c for c in claims if c.ticket < ticket and not c.claimed_bytes]
        if not earlier or time.monotonic() >= deadline:
            # Those that claimed after this one and still load wait for it, then size
            # themselves from what it holds: counting them too would leave it nothing.
            return [c for c in claims if c.ticket < ticket or c.claimed_bytes]
        log.info(
            "waiting for %s to load its model before sizing this worker's memory",
            ", ".join(f"{c.name} (pid {c.pid})" for c in earlier),
        )
        time.sleep(WAIT_POLL_S)


def claim_loaded(conn: redis.Redis, name: str, fraction: float, claimed_bytes: int) -> None:
    """This process has loaded its model and holds ``claimed_bytes``: the workers waiting
    for it go on, and count that much while it has no record published."""
    key = keys.starting_workers(socket.gethostname())
    me = Starting(name, os.getpid(), fraction, claimed_bytes=claimed_bytes)
    conn.hset(key, str(me.pid), msgspec.json.encode(me))


def _unpublished(conn: redis.Redis, key: str) -> list[Starting]:
    """The claims of this host's other workers that run and have no record published
    (claims of ended processes are dropped)."""
    raw = {k.decode(): v for k, v in conn.hgetall(key).items()}
    published = {w.pid for w in neighbours(conn)}
    out, ended = [], []
    for field, value in raw.items():
        if not field.isdigit():
            continue
        try:
            claim = msgspec.structs.replace(
                _starting.decode(value), ticket=int(raw.get(f"t:{field}", 0))
            )
        except (msgspec.DecodeError, ValueError):
            continue
        if not process_running(claim.pid):
            ended += [field, f"t:{field}"]
        elif claim.pid != os.getpid() and claim.pid not in published:
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
    ``workers`` (this host's live workers, :func:`neighbours`) and this host's workers
    with no record published (``starting``, :func:`claim_start`)."""
    memory = facts.recommended_bytes
    own = int(memory * fraction)
    others = tuple(w for w in workers if w.memory_domain == facts.memory_domain)
    loading = tuple((s, s.claimed_bytes or int(memory * s.fraction)) for s in starting)
    if not others and not loading:
        return Share(own, own)
    ceiling = int(memory * max(fraction, DEFAULTS.memory_fraction))
    left = ceiling - sum(claimed(w) for w in others) - sum(b for _, b in loading)
    return Share(max(0, min(own, left)), ceiling, others, loading)


def process_running(pid: int) -> bool:
    """Whether a process of this host runs as ``pid`` (a crashed worker's record lingers
    until it expires). An exited worker its parent has not reaped yet (a zombie, on
    Linux) does not: its claim would hold memory it gave back, or keep a starting worker
    waiting for a load that never comes."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): kill's answer stands
        return True


def release_claim(conn: redis.Redis) -> None:
    """Drop this process's claim on a clean exit (a crashed one's goes once it ends)."""
    key = keys.starting_workers(socket.gethostname())
    pid = str(os.getpid())
    conn.hdel(key, pid, f"t:{pid}")
