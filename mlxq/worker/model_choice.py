"""Which model a worker of several models has loaded, and which it keeps in memory: plain
scheduling policy (no MLX, no Redis), fed by the worker loop and tested alone.

A worker serves one model at a time: it pulls only from that model's own queues and the
shared ones (``default``, or ``--queue`` names that are no served model's own). The rule:

- **Stay** while no other model's own queues have jobs waiting.
- **Switch at once** when the loaded model's queues (its own and the shared ones) are empty
  and another model's queue has work (running jobs finish first; the worker takes none).
- **Switch after a dwell** when both have work: the loaded model keeps the worker for at
  least ``min_seconds`` (``--min-model-seconds``), so it cannot be switched back and forth
  faster than that; then another model's waiting jobs take it.
- **Which next**: the model whose queue has waited longest, counted from when the worker
  first saw its jobs waiting after it last served that model; ties go to the deepest queue,
  then to the order the models were given.

Starvation-freedom: a model waiting since ``t`` is passed over only by models whose wait
began at or before ``t``; each of them, once served, waits again from a later time. So of
``k`` models, one with work waits at most ``k - 1`` turns, each at most ``min_seconds`` plus
the time to finish the running jobs and load a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Weights of models kept loaded beside the active one may take at most this share of the
# worker's memory: the active model's KV cache (its batch) keeps the rest. The active
# model's own weights may take more (a worker of one model can).
RESIDENT_SHARE = 0.5


@dataclass(frozen=True)
class Switch:
    """A decision to change the loaded model: to which, and why (one line for the log)."""

    to: str
    why: str


class ModelChoice:
    """The switching decision of one worker (times are the caller's clock, in seconds)."""

    def __init__(self, models: Sequence[str], active: str, min_seconds: float, now: float):
        if active not in models:
            raise ValueError(f"the active model {active!r} is not one of {list(models)}")
        self.models = list(models)
        self.active = active
        self.min_seconds = min_seconds
        self.active_since = now
        # When this worker first saw jobs waiting on a model's own queues since it last
        # served that model (only models with work waiting, never the active one).
        self.waiting_since: dict[str, float] = {}

    def decide(self, now: float, waiting: Mapping[str, int], shared: int = 0) -> Switch | None:
        """The switch to make now, or None to stay.

        ``waiting``: jobs waiting on each model's own queues; ``shared``: jobs waiting on
        the queues any loaded model serves (they count as the active model's work)."""
        self._note_waiting(now, waiting)
        if not self.waiting_since:
            return None
        nxt = min(
            self.waiting_since,
            key=lambda m: (self.waiting_since[m], -waiting.get(m, 0), self.models.index(m)),
        )
        own = waiting.get(self.active, 0) + shared
        queued = f"{nxt}'s queue has {waiting.get(nxt, 0)} waiting"
        if own == 0:
            return Switch(nxt, f"{self.active}'s queues are empty and {queued}")
        served = now - self.active_since
        if served >= self.min_seconds:
            waited = now - self.waiting_since[nxt]
            return Switch(
                nxt,
                f"{served:.0f}s on {self.active} (at least {self.min_seconds:g}s while it has "
                f"work) and {queued} since {waited:.0f}s",
            )
        return None

    def switched(self, to: str, now: float) -> None:
        """``to`` is the loaded model from ``now`` on (once loaded: its dwell starts)."""
        self.active, self.active_since = to, now
        self.waiting_since.pop(to, None)

    def _note_waiting(self, now: float, waiting: Mapping[str, int]) -> None:
        for m in self.models:
            if m != self.active and waiting.get(m, 0) > 0:
                self.waiting_since.setdefault(m, now)
            else:
                self.waiting_since.pop(m, None)


def to_unload(
    active: str, resident: Mapping[str, int], limit_bytes: int, share: float = RESIDENT_SHARE
) -> list[str]:
    """The models to unload before ``active`` runs, least recently used first.

    ``resident``: the weights (bytes) of every loaded model, least recently used first, with
    ``active`` among them; ``limit_bytes``: what the worker may hold of its memory. Others
    stay while all the weights together take at most ``share`` of it."""
    total = sum(resident.values())
    out: list[str] = []
    for name, size in resident.items():
        if total <= limit_bytes * share:
            break
        if name != active:
            out.append(name)
            total -= size
    return out
