"""A batch wider than the old automatic 256 rows (issue 29 item 5): every job of 300
decoding together, some joining while the others run, keeps mlx-lm's tokens."""

from __future__ import annotations

from typing import Any

import pytest
from engine_reference import random_requests, reference

from mlxq.engine.mlx_lm_batch import Completion
from mlxq.engine.sampling import EngineJob
from mlxq.engine.slots.choices import BUCKETS_ENV, COMPILE_ENV, OVERLAP_ENV
from mlxq.engine.slots.engine import SlotEngine
from mlxq.wire import Request

JOBS = 300
FIRST = 270  # admitted at once; the rest join while these decode


def wide_requests() -> dict[str, Request]:
    """300 short prompts of varied lengths, outputs ending at different lengths."""
    return random_requests(JOBS, 29, (2, 24), (3, 14))


# The CPU's defaults, MLX's fused attention kernel, and CUDA's defaults (a compiled
# forward, steps built while the last one runs, bucketed prefill shapes).
CUDA_LIKE = {COMPILE_ENV: "1", OVERLAP_ENV: "1", BUCKETS_ENV: "1"}


@pytest.mark.parametrize(
    ("attention", "env"), [("gqa", {}), ("fused", {}), ("gqa", CUDA_LIKE)], ids=str
)
def test_300_rows_keep_mlx_lms_tokens(
    tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, attention: str, env: dict[str, str]
) -> None:
    model, tokenizer = tiny
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    engine = SlotEngine.from_loaded(
        model, tokenizer, "tiny", max_batch=320, prefill_batch=64, attention=attention
    )
    assert engine.choices.compiled is (COMPILE_ENV in env)
    jobs = wide_requests()
    pending = list(jobs.items())
    done: dict[str, Completion] = {}
    widest = steps = 0
    while pending or engine.active:
        # The first 270 at once, the last 30 two steps later, while those decode.
        take = FIRST if steps == 0 else (JOBS - FIRST if steps == 2 else 0)
        for key, request in pending[:take]:
            assert engine.add(EngineJob(key, request)) is None
        pending = pending[take:]
        for c in engine.step():
            done[c.key] = c
        widest = max(widest, len(engine.batch.rows))
        steps += 1
    assert widest > 256, f"at most {widest} rows decoded together"
    for key, request in jobs.items():
        ref = reference(model, tokenizer, engine.encode(request), request)
        assert done[key].token_ids == ref["tokens"], key
        assert done[key].finish_reason in ("length", "stop")
    assert engine.batch.cache.free_slots == 320  # every slot given back
