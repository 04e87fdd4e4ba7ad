"""Rows moved between slots (sorted by length) never change a token (issue 31).

A sort moves live rows into the slots of rows that finished while the step in flight
still held them: that step must still find each moved row, and feed it the token it
sampled, not the row's one-step-old host token. Checked on hundreds of rows joining,
finishing at their own steps (EOS and ``max_tokens``) and sorting, against mlx-lm's
single-request greedy output; and as a property of the step's input bookkeeping.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_reference import reference, run_all
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from mlxq.engine.slots import choices as slot_choices
from mlxq.engine.slots import engine as slot_engine
from mlxq.engine.slots import order as slot_order
from mlxq.engine.slots import step as slot_step
from mlxq.engine.slots.cache import SlotCache
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.slots.step import Row, Step, move_rows, step_inputs
from mlxq.wire import Request

ROWS = 256


@pytest.fixture(scope="module")
def varied(tiny, tiny_model_dir: Path) -> tuple[Any, dict[str, Request], dict[str, list[int]]]:
    """A tokenizer whose EOS ids are tokens the tiny model often emits (so rows end at
    their own steps, inside a step in flight), ``ROWS`` jobs of varied prompt and output
    lengths, and mlx-lm's greedy tokens for each under that EOS."""
    model, tokenizer = tiny
    rng = random.Random(31)
    jobs = {}
    for i in range(ROWS):
        prompt = [rng.randrange(5, 500) for _ in range(rng.randint(1, 80))]
        jobs[f"j{i}"] = Request(prompt=prompt, max_tokens=rng.randint(4, 60))
    free = {k: reference(model, tokenizer, r.prompt, r)["tokens"] for k, r in jobs.items()}
    # Not the two commonest tokens: they would end most rows within a few steps.
    common = Counter(t for tokens in free.values() for t in tokens).most_common(5)
    eos = [t for t, _ in common[2:]]
    # mlx-lm stops at the first EOS: the same tokens up to it.
    expected = {k: next((t[:i] for i, x in enumerate(t) if x in eos), t) for k, t in free.items()}
    return load_tokenizer(tiny_model_dir, eos_token_ids=eos), jobs, expected


@pytest.mark.parametrize(
    ("group_rows", "sort_every", "join_every", "overlap", "streams"),
    [(4, 1, 1, "0", "2"), (4, 3, 0, "1", "2"), (8, 4, 2, "0", "1")],
)
def test_hundreds_of_sorted_rows_equal_single_requests(
    tiny,
    varied: tuple[Any, dict[str, Request], dict[str, list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    group_rows: int,
    sort_every: int,
    join_every: int,
    overlap: str,
    streams: str,
) -> None:
    """Small attention groups and frequent sorts make moves common (the defaults make
    them rare on a model this small, not harmless); the groups shared out among two CPU
    streams, or on one."""
    model, _ = tiny
    tokenizer, jobs, expected = varied
    monkeypatch.setattr(slot_step, "GROUP_ROWS", group_rows)
    monkeypatch.setattr(slot_engine, "SORT_EVERY", sort_every)
    monkeypatch.setattr(slot_order, "SORT_GAIN", 0.999)
    monkeypatch.setenv(slot_choices.SORT_ENV, "1")
    monkeypatch.setenv(slot_choices.COMPILE_ENV, "0")  # (the compiled forward never sorts)
    monkeypatch.setenv(slot_choices.OVERLAP_ENV, overlap)
    if mx.default_device() == mx.cpu:
        monkeypatch.setenv(slot_choices.DECODE_STREAMS_ENV, streams)
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=ROWS, prefill_batch=16)
    done = run_all(engine, dict(jobs), join_every)
    wrong = [k for k in jobs if done[k].token_ids != expected[k]]
    assert not wrong, f"{len(wrong)}/{len(jobs)} differ from mlx-lm, e.g. {wrong[:5]}"
    reasons = Counter(c.finish_reason for c in done.values())
    assert reasons["stop"] >= 30 and reasons["length"] >= 30, reasons  # both kinds of end
    assert engine.stats().sorts >= 5 and engine.batch.cache.free_slots == ROWS


def _row(slot: int, next_input: int) -> Row:
    # Only ``slot`` and ``next_input`` take part in a step's input bookkeeping.
    return Row(None, slot, None, [], next_input)  # type: ignore[arg-type]


@st.composite
def _moves(draw: st.DrawFn) -> tuple[list[Row], Step, dict[int, Row], list[int]]:
    """A step in flight over some rows; some of them finish meanwhile, new rows join into
    free slots (lowest first), and the live rows are then moved into any order."""
    slots = draw(st.lists(st.integers(0, 23), min_size=1, max_size=16, unique=True))
    prev_rows = [_row(s, 100 + s) for s in sorted(slots)]
    step = Step(prev_rows, mx.array([1000 + i for i in range(len(prev_rows))]), mx.zeros((1,)))
    finished = draw(st.lists(st.sampled_from(prev_rows), unique_by=id))
    live = {r.slot: r for r in prev_rows if all(r is not f for f in finished)}
    free = sorted(set(range(24)) - set(live))
    for slot in free[: draw(st.integers(0, 6))]:
        live[slot] = _row(slot, 500 + slot)
    order = draw(st.permutations(sorted(live))) if live else []
    return prev_rows, step, live, list(order)


@settings(max_examples=300, deadline=None, database=None)
@given(_moves(), st.data())
def test_moved_rows_take_their_own_tokens_from_the_step_in_flight(
    moves: tuple[list[Row], Step, dict[int, Row], list[int]], data: st.DataObject
) -> None:
    """Whatever rows finished and moved since a step was launched, the next step feeds
    each row that step's token for it if it was there, else its own host token."""
    prev_rows, step, live, order = moves
    rows = move_rows(live, order)
    assert sorted(rows) == list(range(len(order)))
    assert all(slot == r.slot for slot, r in rows.items())
    # Rows whose step in flight gave them their last token (``max_tokens``) sit it out.
    decoding = [r for _, r in sorted(rows.items()) if data.draw(st.booleans())]
    if not decoding:
        return
    cache = SlotCache(num_layers=1, slots=24)  # no arrays: bookkeeping only
    width = decoding[-1].slot + 1
    _, inputs = step_inputs(cache, decoding, step, width)
    got = inputs.tolist()
    index = {id(r): i for i, r in enumerate(prev_rows)}
    for r in decoding:
        want = 1000 + index[id(r)] if id(r) in index else r.next_input
        assert got[r.slot] == want, f"row now in slot {r.slot}"


def test_sorting_asked_of_the_compiled_forward_is_refused(tiny, monkeypatch) -> None:
    """The compiled forward never sorts: ``MLXQ_SLOT_SORT=1`` with it fails at start,
    saying what to change, instead of being dropped (it was, silently, on CUDA)."""
    model, tokenizer = tiny
    monkeypatch.setenv(slot_choices.COMPILE_ENV, "1")
    monkeypatch.setenv(slot_choices.SORT_ENV, "1")
    with pytest.raises(ValueError, match="MLXQ_SLOT_SORT=1 needs the eager decode forward"):
        SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=4)
    monkeypatch.delenv(slot_choices.SORT_ENV)  # the default: sorting where it applies
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=4)
    assert engine.choices.compiled and not engine.choices.sorting
