"""The slot cache follows the work (issue 31): it holds rows for the jobs admitted, grown
as they join and shrunk as they leave, and nothing when idle; a lone long job costs what
it costs in mlx-lm; and the tokens stay mlx-lm's through every resize."""

from __future__ import annotations

import itertools
import random
from typing import Any

import mlx.core as mx
import pytest
from engine_reference import reference, run_all

from mlxq.engine.hardware import backend_name
from mlxq.engine.sampling import EngineJob
from mlxq.engine.scheduler import Scheduler, cache_rows
from mlxq.engine.slots.cache import SlotCache
from mlxq.engine.slots.engine import SlotEngine
from mlxq.wire import Request

LONG = Request(prompt=[5 + (i * 7) % 400 for i in range(1500)], max_tokens=16)


def _peak(run: Any) -> int:
    """Peak bytes of MLX memory ``run()`` takes over what was held before it."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    run()
    mx.synchronize()
    return mx.get_peak_memory() - held


def test_a_lone_long_job_costs_what_it_costs_in_mlx_lm(tiny) -> None:
    """One 1,500-token prompt on an engine of 256 rows: the cache held one row (it was
    256 rows of 1,536 positions, 8x mlx-lm's peak), and nothing once the job ended."""
    model, tokenizer = tiny
    want: list[int] = []
    mlx_lm_peak = _peak(
        lambda: want.extend(reference(model, tokenizer, LONG.prompt, LONG)["tokens"])
    )
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=256)
    engine.warmup()
    done: dict[str, Any] = {}
    peak = _peak(lambda: done.update(run_all(engine, {"long": LONG})))
    assert done["long"].token_ids == want
    assert peak <= 2 * mlx_lm_peak, f"{peak / 2**20:.1f} MiB vs mlx-lm's {mlx_lm_peak / 2**20:.1f}"
    assert engine.batch.cache.rows == 0 and engine.batch.cache.nbytes == 0


def test_the_cache_grows_as_jobs_join_shrinks_as_they_leave_and_tokens_stay(
    tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs joining one at a time, then a second wave after most have ended: each resize
    holds no more rows than the jobs admitted (rounded as the scheduler counts them); the
    rows grow a few times (not once per join) and shrink as jobs leave; every output
    equals mlx-lm's."""
    model, tokenizer = tiny
    rng = random.Random(5)
    jobs = {}
    for i in range(48):
        prompt = [rng.randrange(5, 500) for _ in range(rng.randint(1, 300))]
        jobs[f"j{i}"] = Request(prompt=prompt, max_tokens=rng.randint(2, 40))
    pending, done = list(jobs.items()), {}
    resizes: list[tuple[int, int]] = []  # (rows, jobs admitted then)
    resize = SlotCache.resize

    def recorded(c: SlotCache, rows: int, capacity: int, order: list[int] | None = None) -> None:
        resize(c, rows, capacity, order)
        resizes.append((rows, len(jobs) - len(pending) - len(done)))

    monkeypatch.setattr(SlotCache, "resize", recorded)
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=64, prefill_batch=4)
    while pending or engine.active:
        # A first wave of 32, one a step; the rest once fewer than 4 run.
        if pending and (len(pending) > 16 or engine.active < 4):
            key, request = pending.pop(0)
            assert engine.add(EngineJob(key, request)) is None
        for c in engine.step():
            done[c.key] = c
    for key, request in jobs.items():
        want = reference(model, tokenizer, request.prompt, request)["tokens"]
        assert done[key].token_ids == want, key
    rows = [r for r, _ in resizes]
    assert all(r <= cache_rows(admitted) for r, admitted in resizes), resizes
    assert max(rows) >= 16 and len(set(rows)) >= 3 and len(resizes) < 24, resizes
    assert any(b < a for a, b in itertools.pairwise(rows)), resizes  # it shrank
    assert engine.batch.cache.rows == 0  # idle: nothing held


def test_the_cache_stays_within_the_schedulers_budget(tiny) -> None:
    """The scheduler's budget and the cache's allocation are one number: jobs admitted
    as a worker admits them (the budget binding: some wait), the cache never holds more."""
    model, tokenizer = tiny
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=256)
    kv = engine.info.kv_bytes_per_token
    budget = 6 * 512 * kv
    scheduler = Scheduler(
        max_batch=256, kv_bytes_per_token=kv, budget_bytes=budget, context_length=2048
    )
    rng = random.Random(9)
    pending = [
        (f"j{i}", Request(prompt=[rng.randrange(5, 500)] * rng.randint(1, 400), max_tokens=24))
        for i in range(30)
    ]
    held, waited = 0, 0
    while pending or engine.active:
        while pending:
            key, request = pending[0]
            if not scheduler.try_admit(key, len(request.prompt), request.max_tokens):
                waited += 1
                break
            pending.pop(0)
            assert engine.add(EngineJob(key, request)) is None
        for c in engine.step():
            assert c.finish_reason == "length"
            scheduler.release(c.key)
        held = max(held, engine.batch.cache.nbytes)
        assert engine.batch.cache.nbytes <= budget
    assert waited and budget // 4 < held <= budget


@pytest.mark.skipif(backend_name() != "cpu", reason="the CPU's cache steps")
def test_on_the_cpu_rows_grow_in_small_steps_and_large_buffers_are_mapped_apart() -> None:
    """On the CPU a row's positions grow by 64, not 256 (the padded cache was most of a
    worker's RSS there), and on Linux glibc maps buffers of 1 MiB and up apart, so a
    resized layer's old buffer goes back to the OS."""
    import sys

    from mlxq.engine.scheduler import CACHE_STEP
    from mlxq.engine.slots.cache import CPU_CACHE_STEP, map_large_buffers

    cache = SlotCache(2, 4)
    assert cache.step == CPU_CACHE_STEP < CACHE_STEP
    assert cache.positions(70) == 2 * CPU_CACHE_STEP  # (a row of 70 tokens: 128 positions)
    assert map_large_buffers() is sys.platform.startswith("linux")
