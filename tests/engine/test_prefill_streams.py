"""A prefill call split over CPU streams (mlxq.engine.slots.prefill_streams): the same
tokens as one stream's prefill and as mlx-lm's single-request greedy generation, with
groups of several lengths, samples of one prompt and a stored prefix; and its settings."""

from __future__ import annotations

import os
from typing import Any

import pytest
from engine_reference import reference, run_all

from mlxq.engine import blas
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.slots.joins import JoinPolicy
from mlxq.engine.slots.prefill_streams import STREAMS_ENV, PrefillStreams, choose_streams
from mlxq.wire import Request


class Recorded:
    """Delegates to a model and records each call's input shape."""

    def __init__(self, model: Any) -> None:
        self.inner, self.calls = model, []

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(tuple(inputs.shape))
        return self.inner(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(5 * i + 17 * n + salt) % 400 + 3 for i in range(n)]


def _samples(done: Any) -> list[list[int]]:
    return [c.token_ids for c in done.choices or []]


def _run(tiny: Any, monkeypatch: Any, streams: str, jobs: dict[str, Request], **options: Any):
    """The jobs on a fresh engine whose prefill uses ``streams``: completions, model calls."""
    monkeypatch.setenv(STREAMS_ENV, streams)
    model = Recorded(tiny[0])
    engine = SlotEngine.from_loaded(model, tiny[1], "tiny", max_batch=16, **options)
    engine.joiner.policy = JoinPolicy(0)
    assert engine.choices.prefill_streams == int(streams)
    return engine, run_all(engine, jobs), model.calls


def test_split_prefill_gives_one_streams_tokens_and_mlx_lms(tiny, monkeypatch) -> None:
    """Six prompts of 1 to 70 tokens in one group, one of them with 3 samples: split over
    two streams, every token equals one stream's and mlx-lm's; the split calls hold the
    group's rows in two parts at the group's width."""
    jobs = {f"p{n}": Request(prompt=_prompt(n), max_tokens=10) for n in (9, 1, 70, 33, 2, 50)}
    jobs["p9"].n, jobs["p9"].temperature, jobs["p9"].seed = 3, 0.8, 4
    engine, split, calls = _run(tiny, monkeypatch, "2", jobs, prefill_batch=8)
    _, alone, one_calls = _run(tiny, monkeypatch, "1", jobs, prefill_batch=8)
    assert (3, 69) in calls and (6, 69) not in calls  # (the group's width: 70 less 1)
    assert (6, 69) in one_calls
    for key, request in jobs.items():
        assert split[key].error is None, split[key].error
        assert split[key].token_ids == alone[key].token_ids, key
        assert _samples(split[key]) == _samples(alone[key]), key
        if request.n == 1:
            want = reference(*tiny, engine.encode(request), request)["tokens"]
            assert split[key].token_ids == want, key


def test_split_prefill_after_a_stored_prefix(tiny, monkeypatch) -> None:
    """Jobs that reuse a stored 160-token prefix, prefilled in a split group: the same
    tokens as one stream's, and mlx-lm's."""
    shared = _prompt(160, salt=1)  # (stored once two prompts hold it: 128 tokens or more)
    first = {f"f{n}": Request(prompt=[*shared, *_prompt(n)], max_tokens=4) for n in (6, 9)}
    jobs = {f"q{n}": Request(prompt=[*shared, *_prompt(n, 2)], max_tokens=8) for n in (3, 12, 7)}
    outs = []
    for streams in ("2", "1"):
        monkeypatch.setenv(STREAMS_ENV, streams)
        engine = SlotEngine.from_loaded(*tiny, "tiny", max_batch=8, prefix_cache_bytes=1 << 24)
        engine.joiner.policy = JoinPolicy(0)
        run_all(engine, first, join_every=1)  # (one after the other: the second stores it)
        outs.append(run_all(engine, jobs))
        assert engine.stats().prefix_hits >= len(jobs)
    for key, request in jobs.items():
        assert outs[0][key].token_ids == outs[1][key].token_ids, key
        assert outs[0][key].token_ids == reference(*tiny, request.prompt, request)["tokens"]


def test_parts_are_contiguous_and_never_empty() -> None:
    streams = PrefillStreams(2)
    assert streams.parts(1) == [(0, 1)]
    assert streams.parts(2) == [(0, 1), (1, 2)]
    assert streams.parts(5) == [(0, 2), (2, 5)]
    assert PrefillStreams(3).parts(7) == [(0, 2), (2, 4), (4, 7)]


def test_stream_settings(monkeypatch) -> None:
    monkeypatch.delenv(STREAMS_ENV, raising=False)
    assert choose_streams("cpu") == min(2, os.cpu_count() or 1)
    assert choose_streams("cuda") == 1 and choose_streams("metal") == 1
    monkeypatch.setenv(STREAMS_ENV, "1")
    assert choose_streams("cpu") == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(STREAMS_ENV, bad)
        with pytest.raises(ValueError, match=f"{STREAMS_ENV}={bad!r}: give a whole number"):
            choose_streams("cpu")
    monkeypatch.setenv(STREAMS_ENV, "2")
    with pytest.raises(ValueError, match="CPU streams only"):
        choose_streams("cuda")


def test_blas_threads_are_shared_inside_the_block_and_restored() -> None:
    """With OpenBLAS loaded (the test command preloads it), each of two multiplies at once
    gets half its threads inside the block; elsewhere nothing changes."""
    lib = blas._openblas()
    if lib is None:
        with blas.shared_among(2):
            pass
        return
    before = lib.openblas_get_num_threads()
    lib.openblas_set_num_threads(4)
    try:
        with blas.shared_among(2):
            assert lib.openblas_get_num_threads() == 2
        assert lib.openblas_get_num_threads() == 4
        with blas.shared_among(8):
            assert lib.openblas_get_num_threads() == 1
        assert lib.openblas_get_num_threads() == 4
    finally:
        lib.openblas_set_num_threads(before)
