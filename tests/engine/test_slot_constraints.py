"""Structured outputs on the slot engine: test_constraints' engine tests, unchanged, with
this module's ``engine`` fixture (constraints ride the slot engine as a batch hook)."""

from __future__ import annotations

import pytest
import test_constraints as base

from mlxq.engine.slots import choices as slot_choices
from mlxq.engine.slots.engine import SlotEngine


@pytest.fixture(params=["0", "1"], ids=["eager", "compiled"])
def engine(tiny, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> SlotEngine:
    """Eager and compiled decode forwards (the compiled one is the CUDA default)."""
    monkeypatch.setenv(slot_choices.COMPILE_ENV, request.param)
    engine = SlotEngine.from_loaded(*tiny, "tiny", max_batch=8)
    assert engine.choices.compiled is (request.param == "1")
    return engine


test_mixed_batch_free_rows_stay_greedy_and_constrained_rows_conform = (
    base.test_mixed_batch_free_rows_stay_greedy_and_constrained_rows_conform
)
test_bounded_schemas_always_finish_even_sampled = (
    base.test_bounded_schemas_always_finish_even_sampled
)
test_grammar_forbids_eos_until_complete = base.test_grammar_forbids_eos_until_complete
test_a_constraint_that_fails_at_the_worker_fails_its_job_alone = (
    base.test_a_constraint_that_fails_at_the_worker_fails_its_job_alone
)
test_logprobs_stop_strings_and_max_tokens_still_apply = (
    base.test_logprobs_stop_strings_and_max_tokens_still_apply
)


def test_the_engine_counts_its_mask_helper_and_its_waits_for_it(engine: SlotEngine) -> None:
    """Free jobs leave the mask and sampling-after counters at zero; constrained ones count
    the helper's time, and the steps' waits for it, for the last tokens and the sampling
    launch never exceed the decode time they are part of."""
    base.run_jobs(engine, {"free": base.Request(prompt=[5, 6, 7], max_tokens=12)})
    free = engine.stats()
    assert free.mask_seconds == free.mask_wait_seconds == 0.0 and free.decode_steps > 0
    assert free.token_wait_seconds == free.sample_launch_seconds == 0.0
    json_job = base.Request(prompt="A person:", max_tokens=60, response_format=base.SCHEMA)
    done = base.run_jobs(engine, {"a": json_job, "b": json_job})
    assert all(c.error is None for c in done.values())
    work = engine.stats().since(free)
    assert work.mask_seconds > 0.0
    assert 0.0 <= work.mask_wait_seconds <= work.decode_seconds
    assert work.token_wait_seconds > 0.0 and work.sample_launch_seconds > 0.0
    waits = work.token_wait_seconds + work.sample_launch_seconds
    assert waits + work.launch_seconds <= work.decode_seconds


def test_each_sample_follows_its_own_constraint(engine: SlotEngine) -> None:
    """A job of several sampled samples under one schema: a matcher per sample, every
    choice conforms, and the samples differ."""
    schema, sampled = base.SCHEMA, {"temperature": 1.0, "top_p": 0.95, "seed": 4}
    request = base.Request(prompt="Person:", max_tokens=150, response_format=schema, n=3, **sampled)
    c = base.run_jobs(engine, {"job": request})["job"]
    assert c.error is None and len(c.choices) == 3
    for choice in c.choices:
        assert choice.finish_reason == "stop", choice.text
        base.stopped_outputs_conform(request, choice)
    assert len({ch.text for ch in c.choices}) > 1
