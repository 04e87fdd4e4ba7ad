"""The switching policy of a worker of several models (mlxq.worker.model_choice), alone:
when it switches, which model next, that no model with work waits forever, and that
switching back and forth is bounded by the dwell."""

from __future__ import annotations

import random

import pytest

from mlxq.worker.model_choice import ModelChoice, to_unload


def test_stays_while_no_other_model_has_work():
    choice = ModelChoice(["a", "b"], "a", min_seconds=60, now=0)
    assert choice.decide(1000, {"a": 0, "b": 0}) is None
    assert choice.decide(1000, {"a": 5, "b": 0}, shared=3) is None


def test_switches_at_once_when_the_loaded_models_queues_are_empty():
    choice = ModelChoice(["a", "b"], "a", min_seconds=60, now=0)
    switch = choice.decide(1, {"a": 0, "b": 2})
    assert switch is not None and switch.to == "b"
    assert "a's queues are empty" in switch.why and "b's queue has 2 waiting" in switch.why


def test_shared_queue_work_keeps_the_loaded_model_for_its_dwell():
    choice = ModelChoice(["a", "b"], "a", min_seconds=60, now=0)
    assert choice.decide(10, {"a": 0, "b": 2}, shared=4) is None
    switch = choice.decide(60, {"a": 0, "b": 2}, shared=4)
    assert switch is not None and switch.to == "b" and "60s on a" in switch.why


def test_dwell_counts_from_when_the_model_was_loaded():
    choice = ModelChoice(["a", "b"], "a", min_seconds=60, now=0)
    assert choice.decide(59.9, {"a": 1, "b": 1}) is None
    assert choice.decide(60, {"a": 1, "b": 1}).to == "b"
    choice.switched("b", 75)  # (loading took 15 s)
    assert choice.decide(134, {"a": 1, "b": 1}) is None
    assert choice.decide(135, {"a": 1, "b": 1}).to == "a"


def test_zero_dwell_switches_whenever_another_model_waits():
    choice = ModelChoice(["a", "b"], "a", min_seconds=0, now=0)
    assert choice.decide(0, {"a": 9, "b": 1}).to == "b"


def test_next_is_the_model_that_waited_longest_then_the_deepest_then_the_first_given():
    choice = ModelChoice(["a", "b", "c", "d"], "a", min_seconds=60, now=0)
    assert choice.decide(1, {"a": 5, "c": 1}) is None  # c waits from 1
    assert choice.decide(2, {"a": 5, "b": 100, "c": 1}) is None  # b from 2
    assert choice.decide(60, {"a": 5, "b": 100, "c": 1}).to == "c"  # longest, not deepest
    tie = ModelChoice(["a", "b", "c", "d"], "a", min_seconds=0, now=0)
    assert tie.decide(1, {"b": 1, "c": 7, "d": 7}).to == "c"  # same wait: the deepest
    tie = ModelChoice(["a", "b", "c", "d"], "a", min_seconds=0, now=0)
    assert tie.decide(1, {"b": 3, "c": 3, "d": 3}).to == "b"  # then the order given


def test_a_model_whose_queue_emptied_starts_waiting_afresh():
    choice = ModelChoice(["a", "b", "c"], "a", min_seconds=60, now=0)
    choice.decide(1, {"a": 1, "b": 1})  # b from 1
    choice.decide(2, {"a": 1, "b": 0, "c": 1})  # b emptied (another worker); c from 2
    assert choice.decide(3, {"a": 1, "b": 1, "c": 1}) is None
    assert choice.decide(60, {"a": 1, "b": 1, "c": 1}).to == "c"


def _serve(models: list[str], min_seconds: float, steps: int, seed: int) -> dict[str, float]:
    """Every model always has work; a switch takes 5 s. The longest any model with work
    waited between being served (from when it was first seen waiting)."""
    rng = random.Random(seed)
    choice = ModelChoice(models, models[0], min_seconds, now=0)
    now, longest = 0.0, dict.fromkeys(models, 0.0)
    left_at = dict.fromkeys(models, 0.0)
    for _ in range(steps):
        now += rng.uniform(0.1, 20)
        waiting = {m: rng.randint(1, 1000) for m in models}
        switch = choice.decide(now, waiting)
        if switch is not None:
            left_at[choice.active] = now
            now += 5
            longest[switch.to] = max(longest[switch.to], now - left_at[switch.to])
            choice.switched(switch.to, now)
    return longest


@pytest.mark.parametrize("seed", range(5))
def test_no_model_with_work_starves_and_switching_is_bounded(seed: int):
    models = ["a", "b", "c", "d"]
    longest = _serve(models, min_seconds=60, steps=2000, seed=seed)
    # A turn lasts at most the dwell, one decision interval (<= 20 s) and the switch (5 s):
    # a waiting model is passed over at most len(models) - 1 times.
    turn = 60 + 20 + 5
    assert all(0 < w <= (len(models) - 1) * turn + 20 for w in longest.values()), longest


def test_dwell_bounds_how_often_it_switches():
    choice = ModelChoice(["a", "b"], "a", min_seconds=30, now=0)
    switches, now = 0, 0.0
    while now < 3600:
        now += 0.5
        switch = choice.decide(now, {"a": 3, "b": 3})
        if switch is not None:
            switches += 1
            choice.switched(switch.to, now)
    assert switches == 3600 // 30


def test_the_active_model_must_be_one_of_the_models():
    with pytest.raises(ValueError, match="not one of"):
        ModelChoice(["a"], "b", 0, 0)


def test_models_kept_loaded_while_all_weights_fit_half_the_memory():
    gib = 2**30
    # Three 10 GiB models in 100 GiB: all stay.
    assert to_unload("c", {"a": 10 * gib, "b": 10 * gib, "c": 10 * gib}, 100 * gib) == []
    # 30 GiB each: the least recently used goes until the rest fit 50 GiB.
    assert to_unload("c", {"a": 30 * gib, "b": 30 * gib, "c": 30 * gib}, 100 * gib) == [
        "a",
        "b",
    ]
    # A big active model alone may take more than half; the others go.
    assert to_unload("a", {"a": 70 * gib, "b": 1 * gib}, 100 * gib) == ["b"]
