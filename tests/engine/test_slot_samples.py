"""``n`` samples per request on the slot engine: one prefill, n rows, n choices.

Greedy samples equal mlx-lm's single-request greedy answer; seeded samples repeat run to
run, differ from each other, and sample ``i`` is the single request seeded ``seed + i``;
jobs of several samples join and leave a running batch; a cancel ends every sample.
"""

from __future__ import annotations

import pytest
from engine_reference import REQUESTS, check_against_reference, reference, run_all

from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine
from mlxq.engine.sampling import EngineJob
from mlxq.engine.scheduler import Scheduler
from mlxq.engine.slots.engine import SlotEngine
from mlxq.wire import Request


def slot_engine(tiny, **options) -> SlotEngine:
    model, tokenizer = tiny
    return SlotEngine.from_loaded(model, tokenizer, "tiny", **options)


def test_greedy_samples_equal_the_single_greedy_answer(tiny) -> None:
    model, tokenizer = tiny
    engine = slot_engine(tiny)
    request = Request(prompt="The capital of France is", max_tokens=20, n=4)
    done = run_all(engine, {"job": request, "one": Request(prompt=request.prompt, max_tokens=20)})
    c, one = done["job"], done["one"]
    ref = reference(model, tokenizer, engine.encode(request), request)
    assert c.choices is not None and [ch.index for ch in c.choices] == [0, 1, 2, 3]
    for choice in c.choices:
        assert choice.token_ids == ref["tokens"] == one.token_ids
        assert choice.text == ref["text"] and choice.finish_reason == one.finish_reason
    assert (c.text, c.token_ids, c.finish_reason) == (one.text, one.token_ids, one.finish_reason)
    assert c.completion_tokens == 4 * len(ref["tokens"]) and one.choices is None
    assert c.prompt_tokens == one.prompt_tokens
    # One prefill for the job's prompt, however many samples it has.
    prompt = len(engine.encode(request))
    assert engine.stats().prefilled_tokens == 2 * (prompt - 1)
    assert engine.batch.cache.free_slots == engine.max_batch and engine.active == 0


def seeded(n: int, seed: int = 7) -> Request:
    return Request(prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=seed, n=n)


def test_seeded_samples_repeat_and_differ(tiny) -> None:
    runs = [run_all(slot_engine(tiny), {"job": seeded(4)})["job"] for _ in range(2)]
    first, again = ([ch.token_ids for ch in c.choices] for c in runs)
    assert first == again  # the same seed: the same samples, run to run
    assert len({tuple(t) for t in first}) == 4  # each sample its own seed
    # Sample i is the request seeded seed + i, run alone.
    alone = run_all(slot_engine(tiny), {str(i): seeded(1, 7 + i) for i in range(4)})
    assert first == [alone[str(i)].token_ids for i in range(4)]


def test_each_sample_has_its_own_stop(tiny) -> None:
    request = Request(prompt="Hello", max_tokens=40, temperature=1.0, seed=3, n=6, stop=["e"])
    c = run_all(slot_engine(tiny), {"job": request})["job"]
    assert c.choices is not None and len(c.choices) == 6
    for ch in c.choices:
        assert "e" not in ch.text
        assert ch.finish_reason == "stop" or len(ch.token_ids) == 40
    assert len({len(ch.token_ids) for ch in c.choices}) > 1  # they ended apart


@pytest.mark.parametrize(("max_batch", "join_every"), [(8, 2), (5, 1), (16, 0)])
def test_samples_join_and_leave_a_running_batch(tiny, max_batch: int, join_every: int) -> None:
    """Jobs of 3 and 4 greedy samples among single jobs, joining as others decode and
    finish: every job equals mlx-lm's answer, every slot comes back."""
    model, tokenizer = tiny
    engine = slot_engine(tiny, max_batch=max_batch, prefill_batch=2)
    jobs = {str(i): r for i, r in enumerate(REQUESTS)}
    sampled = {"s3": (REQUESTS[0], 3), "s4": (REQUESTS[3], 4), "s5": (REQUESTS[2], 5)}
    mixed = dict(list(jobs.items())[:2])
    for key, (r, n) in sampled.items():
        mixed[key] = Request(prompt=r.prompt, max_tokens=r.max_tokens, n=n)
    mixed.update(list(jobs.items())[2:])
    done = run_all(engine, mixed, join_every)
    check_against_reference(tiny, engine, done)
    for key, (r, n) in sampled.items():
        ref = reference(model, tokenizer, engine.encode(r), r)
        assert [ch.token_ids for ch in done[key].choices] == [ref["tokens"]] * n, key
    assert engine.batch.cache.free_slots == max_batch and engine.active == 0


def test_cancel_ends_every_sample(tiny) -> None:
    engine = slot_engine(tiny)
    # (Seeded: unseeded, a sample draws the end of text within 4 steps now and then.)
    request = Request(prompt="Once upon a time", max_tokens=200, temperature=1.0, n=3, seed=7)
    assert engine.add(EngineJob("job", request)) is None
    assert engine.active == 3
    for _ in range(4):
        assert engine.step() == []
    c = engine.cancel("job")
    assert c is not None and c.key == "job" and c.finish_reason == "cancelled"
    assert [ch.finish_reason for ch in c.choices] == ["cancelled"] * 3
    assert all(ch.token_ids for ch in c.choices)  # what each had generated is kept
    assert engine.active == 0 and engine.batch.cache.free_slots == engine.max_batch
    assert engine.cancel("job") is None


def test_more_samples_than_rows_fail_alone(tiny) -> None:
    engine = slot_engine(tiny, max_batch=4)
    failed = engine.add(EngineJob("big", Request(prompt="Hi", n=5)))
    assert failed is not None and failed.finish_reason == "error"
    assert "--max-batch 5" in failed.error and engine.active == 0


def test_the_batch_generator_engine_refuses_samples(tiny) -> None:
    model, tokenizer = tiny
    engine = BatchGeneratorEngine.from_loaded(model, tokenizer, "tiny")
    failed = engine.add(EngineJob("job", Request(prompt="Hi", n=2)))
    assert failed is not None and failed.finish_reason == "error" and "slot engine" in failed.error


def test_the_scheduler_counts_a_row_per_sample() -> None:
    s = Scheduler(max_batch=8, kv_bytes_per_token=1, budget_bytes=2**40, context_length=4096)
    assert s.try_admit("a", 10, 10, rows=6)
    assert not s.try_admit("b", 10, 10, rows=3)  # 6 + 3 rows > 8
    assert s.try_admit("c", 10, 10, rows=2) and s.active == 8
    s.release("a")
    assert s.active == 2 and s.try_admit("b", 10, 10, rows=3)
    # An empty batch always takes a job (the engine refuses one it can never seat).
    empty = Scheduler(max_batch=4, kv_bytes_per_token=1, budget_bytes=2**40, context_length=99)
    assert empty.try_admit("big", 1, 1, rows=9)
