"""What ``mlxq dashboard`` flags: work no live worker serves, and batches that stopped moving.

Plain functions over what the snapshot already read; each flag is a sentence the page shows
as it is (and ``/api/state`` carries for scripts).
"""

from __future__ import annotations

from mlxq.wire import BatchInfo, BatchStatus, WorkerInfo

STUCK_AFTER_S = 300.0  # a batch with work left and no job done for this long is flagged


def span(seconds: float) -> str:
    """A duration as people say it: ``45 s``, ``7 min``, ``2.5 h``, ``3.0 d``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds // 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def serving(workers: list[WorkerInfo], stalled: set[str]) -> dict[str, tuple[int, int]]:
    """For each queue: (live workers serving it, stalled workers listed on it)."""
    out: dict[str, tuple[int, int]] = {}
    for w in workers:
        for name in set(w.queues):
            live, dead = out.get(name, (0, 0))
            out[name] = (live, dead + 1) if w.name in stalled else (live + 1, dead)
    return out


def unserved(queue: str, live: int, stalled: int) -> str:
    """The flag of a queue that has jobs waiting and no live worker."""
    if stalled:
        return f"no worker serves queue {queue} ({stalled} stalled)"
    return f"no worker serves queue {queue}"


def batch_flags(
    info: BatchInfo,
    s: BatchStatus,
    quiet_s: float | None,
    stuck_after_s: float,
    served: dict[str, tuple[int, int]],
) -> list[str]:
    """What is wrong with an unfinished batch: its jobs wait on a queue nobody serves, no job
    of it ended for ``stuck_after_s`` (``quiet_s`` is how long it has been), or its submit
    stopped half way."""
    if s.done >= s.total:
        return []
    flags = []
    if s.queued and not served.get(info.queue, (0, 0))[0]:
        flags.append(unserved(info.queue, *served.get(info.queue, (0, 0))))
    if quiet_s is not None and quiet_s >= stuck_after_s:
        flags.append(f"no progress for {span(quiet_s)}")
    if s.state == "submitting" and not s.submitter_alive:
        flags.append(
            f"its submit stopped after {s.enqueued or 0} of {s.total} jobs "
            f"(finish it with `mlxq submit FILE --resume {info.batch_id}`, or cancel it)"
        )
    return flags
