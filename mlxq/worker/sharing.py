"""Workers sharing one machine's memory: a worker starting where live workers already run
sizes its memory from what they leave (their ``WorkerInfo`` in Redis says what they hold),
or refuses to start.

All the live workers of a host and memory domain (:attr:`DeviceFacts.memory_domain`)
together stay under ``max(--memory-fraction, its default)`` of the memory; a worker never
takes more than its own ``--memory-fraction``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import redis

from mlxq.broker import fleet
from mlxq.engine.hardware import DeviceFacts
from mlxq.wire import WorkerInfo
from mlxq.worker.profile import DEFAULTS


@dataclass(frozen=True)
class Share:
    """What this worker may hold of its memory, and why."""

    limit_bytes: int  # weights + caches of this worker
    ceiling_bytes: int  # what every mlxq worker on this memory may hold together
    others: tuple[WorkerInfo, ...] = ()  # the live workers on the same memory

    @property
    def others_bytes(self) -> int:
        """What the other workers hold."""
        return sum(claimed(w) for w in self.others)

    def describe(self) -> str:
        """The decision in words (for the log and for a refusal)."""
        names = ", ".join(
            f"{w.name} (pid {w.pid}): {claimed(w) / 2**30:.1f} GiB" for w in self.others
        )
        return (
            f"{len(self.others)} live worker(s) on this host's memory ({names}) hold "
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


def share(facts: DeviceFacts, fraction: float, workers: list[WorkerInfo]) -> Share:
    """What a worker asking for ``fraction`` of ``facts``' memory may hold beside
    ``workers`` (this host's live workers, :func:`neighbours`)."""
    memory = facts.recommended_bytes
    own = int(memory * fraction)
    others = tuple(w for w in workers if w.memory_domain == facts.memory_domain)
    if not others:
        return Share(own, own)
    ceiling = int(memory * max(fraction, DEFAULTS.memory_fraction))
    left = ceiling - sum(claimed(w) for w in others)
    return Share(max(0, min(own, left)), ceiling, others)


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
