"""A decode step's attention groups shared out among CPU streams (mlxq.engine.slots.order
.share_out, DecodeState): each stream's share of the work, and through the engine the
same tokens as on one stream and as mlx-lm's single-request greedy generation."""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import mlx.core as mx
import pytest
from engine_reference import random_requests, reference, run_all

from mlxq.engine.slots import step as slot_step
from mlxq.engine.slots.cache import DecodeState
from mlxq.engine.slots.choices import DECODE_STREAMS_ENV
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.slots.order import share_out
from mlxq.engine.slots.prefill_streams import choose_streams


def test_one_group_is_halved_and_each_stream_takes_one() -> None:
    assert share_out([(0, 128, 160)], 2) == [(0, 64, 160, 0), (64, 128, 160, 1)]
    assert share_out([(0, 1, 32)], 2) == [(0, 1, 32, 0)]  # (one row: nothing to halve)
    assert share_out([(0, 64, 96), (64, 128, 96)], 2) == [(0, 64, 96, 0), (64, 128, 96, 1)]


def test_a_wide_group_is_split_until_the_streams_share_evenly() -> None:
    """64 rows of 400 positions beside 64 of 100: the wide group is halved, its halves go
    to both streams and the narrow group to the one with less."""
    parts = share_out([(0, 64, 400), (64, 128, 100)], 2)
    assert parts == [(0, 32, 400, 0), (32, 64, 400, 1), (64, 128, 100, 0)]
    load = [sum((e - s) * n for s, e, n, k in parts if k == i) for i in (0, 1)]
    assert load == [19200, 12800]


def test_parts_cover_every_row_once_and_keep_their_span() -> None:
    rng = random.Random(5)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, 300), rng.randint(0, 5)))
        bounds = [0, *cuts, 300]
        groups = [(a, b, rng.choice([32, 64, 512])) for a, b in itertools.pairwise(bounds)]
        for streams in (2, 3):
            parts = share_out(groups, streams)
            rows = [r for s, e, _, _ in parts for r in range(s, e)]
            assert rows == list(range(300))
            assert {k for *_, k in parts} <= set(range(streams))
            for s, e, span, _ in parts:
                assert any(a <= s and e <= b and n == span for a, b, n in groups)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU streams")
def test_split_decode_gives_one_streams_tokens_and_mlx_lms(tiny, monkeypatch) -> None:
    """40 jobs joining every step in groups of 8 rows: every step's groups run on two
    streams, and every token equals one stream's and mlx-lm's."""
    monkeypatch.setattr(slot_step, "GROUP_ROWS", 8)
    seen: list[int] = []
    make = DecodeState.make

    def spy(*args: Any, **kwargs: Any) -> DecodeState:
        state = make(*args, **kwargs)
        seen.append(len({str(s) for s in state.streams or [None]}))
        return state

    monkeypatch.setattr(DecodeState, "make", spy)
    jobs, outs = random_requests(40, 8, (1, 90), (3, 40), vocab=500), []
    for streams in ("2", "1"):
        monkeypatch.setenv(DECODE_STREAMS_ENV, streams)
        engine = SlotEngine.from_loaded(*tiny, "tiny", max_batch=24)
        assert engine.choices.decode_streams == int(streams)
        outs.append(run_all(engine, jobs, join_every=1))
        # (a step of 2 rows or more splits; here nearly every step has several)
        assert max(seen) == int(streams) and seen.count(int(streams)) > 0.8 * len(seen), seen
        seen.clear()
    for key, request in jobs.items():
        assert outs[0][key].token_ids == outs[1][key].token_ids, key
        assert outs[0][key].token_ids == reference(*tiny, request.prompt, request)["tokens"], key


def test_decode_stream_settings(monkeypatch) -> None:
    monkeypatch.delenv(DECODE_STREAMS_ENV, raising=False)
    assert choose_streams("cpu", DECODE_STREAMS_ENV) == min(2, os.cpu_count() or 1)
    assert choose_streams("cuda", DECODE_STREAMS_ENV) == 1
    monkeypatch.setenv(DECODE_STREAMS_ENV, "0")
    with pytest.raises(ValueError, match=f"{DECODE_STREAMS_ENV}='0': give a whole number"):
        choose_streams("cpu", DECODE_STREAMS_ENV)
    monkeypatch.setenv(DECODE_STREAMS_ENV, "2")
    with pytest.raises(ValueError, match="CPU streams only"):
        choose_streams("metal", DECODE_STREAMS_ENV)
