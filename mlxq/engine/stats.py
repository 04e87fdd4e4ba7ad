"""What an engine has done: prompt, prefill, decode and prefix-cache counts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class EngineStats:
    """What an engine has done since it was made (:meth:`~mlxq.engine.protocol.BatchEngine.stats`).

    ``prompt_tokens``: of admitted jobs; ``prefilled_tokens``: run through the model (not
    a prompt's last token, which the first decode step feeds, nor ``reused_tokens``, taken
    from the prefix cache). ``prefill_seconds`` includes copies to and from that cache
    (not the wait for a decode step in flight before a group is written: decode time);
    ``prefix_cache_bytes`` is what it holds now. ``decode_steps`` and ``launch_seconds``
    (the host building and launching them, within ``decode_seconds``) tell a host-bound
    engine from a device-bound one; the ``BatchGenerator`` engine leaves them at 0.
    ``mask_seconds``: the constraints' helper thread advancing matchers and filling masks
    (beside the decode steps, on another thread); ``mask_wait_seconds``: the decode steps
    waiting for it (within ``decode_seconds``): a constrained batch whose wait grows is
    bound by its masks, not by the model (the slot engine; the other leaves them at 0).
    Steps that sample after their model's part (constrained rows, per-row processors)
    also count ``token_wait_seconds``, waiting for the last step's tokens on the host (and
    handing them to the hooks), and
    ``sample_launch_seconds``, building and launching their sampling once the masks are
    there (the mask wait included): both within ``decode_seconds``, what such a step costs
    beyond a free one. ``cache_copies``: times the slot engine laid its cache out anew
    (grown, shrunk or sorted: a copy of every layer each), ``cache_copy_seconds`` the host's
    time in them (each layer evaluated in turn, so a copy also waits for a step in flight);
    ``forward_traces``: times its compiled decode forward traced the model (once per new
    cache shape, a graph built in Python).
    """

    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_calls: int = 0  # groups prefilled (the slot engine; each costs host time)
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    launch_seconds: float = 0.0
    mask_seconds: float = 0.0
    mask_wait_seconds: float = 0.0
    token_wait_seconds: float = 0.0
    sample_launch_seconds: float = 0.0
    sorts: int = 0  # times the slot engine moved its rows into length order
    cache_copies: int = 0
    cache_copy_seconds: float = 0.0
    forward_traces: int = 0
    prefix_hits: int = 0
    reused_tokens: int = 0
    stored_tokens: int = 0
    prefix_cache_bytes: int = 0
    prefix_evictions: int = 0

    def since(self, before: EngineStats) -> EngineStats:
        """The work done after the ``before`` snapshot (the cache's size stays as now)."""
        out = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            if f.name != "prefix_cache_bytes":
                setattr(out, f.name, getattr(self, f.name) - getattr(before, f.name))
        return out


def add_work(stats: EngineStats, work: Any) -> None:
    """Add a window of ``BatchGenerator.stats()`` (prefill and decode work) to ``stats``."""
    stats.prefilled_tokens += work.prompt_tokens
    stats.prefill_seconds += work.prompt_time
    stats.generated_tokens += work.generation_tokens
    stats.decode_seconds += work.decode_time
