"""What an engine has done: prompt, prefill, decode and prefix-cache counts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class EngineStats:
    """What an engine has done since it was made (:meth:`Engine.stats`).

    ``prompt_tokens``: of admitted jobs; ``prefilled_tokens``: run through the model (not
    a prompt's last token, which the first decode step feeds, nor ``reused_tokens``, taken
    from the prefix cache). ``prefill_seconds`` includes copies to and from that cache;
    ``prefix_cache_bytes`` is what it holds now.
    """

    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    prefix_hits: int = 0
    reused_tokens: int = 0
    stored_tokens: int = 0
    prefix_cache_bytes: int = 0
    prefix_evictions: int = 0


def with_counters(stats: EngineStats, c: Any) -> EngineStats:
    """``stats`` plus a ``BatchGenerator``'s counters of prefill and decode work."""
    return dataclasses.replace(
        stats,
        prefilled_tokens=stats.prefilled_tokens + c.prompt_tokens,
        prefill_seconds=stats.prefill_seconds + c.prompt_time,
        generated_tokens=stats.generated_tokens + c.generation_tokens,
        decode_seconds=stats.decode_seconds + c.decode_time,
    )
