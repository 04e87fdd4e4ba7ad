"""Prompts of one token and a few: alone, together, joining a running batch, on both engines.

The slot engine prefills a prompt less its last token, which its first decode step feeds:
a one-token prompt prefills nothing. Its cache's arrays are made at their first write, so
a lone one-token job on an idle engine (which holds no arrays) once failed its batch
("cannot lay 1 rows out in 0 of 8"); two tokens, or company, worked. Every prompt length
from 1 up runs here, each job's greedy tokens equal to mlx-lm's single-request output.
A group whose prefill fails is prefilled again job by job, so that only the job at fault
ends in error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_reference import FlakyModel, reference, run_all
from helpers import run_mlxq

from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine
from mlxq.engine.sampling import EngineJob
from mlxq.engine.slots import choices as slot_choices
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.slots.joins import JoinPolicy
from mlxq.engine.slots.prefill_streams import STREAMS_ENV
from mlxq.wire import Request

ENGINES = {"slot": SlotEngine, "batch_generator": BatchGeneratorEngine}


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 31 * n + salt) % 400 + 3 for i in range(n)]


def _jobs(lengths: range | list[int], max_tokens: int = 8) -> dict[str, Request]:
    return {f"p{n}": Request(prompt=_prompt(n), max_tokens=max_tokens) for n in lengths}


def _check(tiny: Any, engine: Any, jobs: dict[str, Request], done: dict[str, Any]) -> None:
    model, tokenizer = tiny
    for key, request in jobs.items():
        c = done[key]
        assert c.error is None and c.finish_reason != "error", (key, c.error)
        want = reference(model, tokenizer, engine.encode(request), request)["tokens"]
        assert c.token_ids == want, key
        assert c.prompt_tokens == len(request.prompt)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_each_prompt_length_from_one_runs_alone(tiny, kind: str) -> None:
    """Each length alone, on a fresh engine and on one that went idle (its cache
    dropped), and a one-token job of two samples (one prefill, two rows)."""
    model, tokenizer = tiny
    reused = ENGINES[kind].from_loaded(model, tokenizer, "tiny", max_batch=8)
    for n in range(1, 9):
        jobs = _jobs([n])
        fresh = ENGINES[kind].from_loaded(model, tokenizer, "tiny", max_batch=8)
        _check(tiny, fresh, jobs, run_all(fresh, jobs))
        _check(tiny, reused, jobs, run_all(reused, jobs))
    if kind == "slot":  # (n > 1: the slot engine only)
        two = Request(prompt=_prompt(1), max_tokens=8, n=2)
        done = run_all(reused, {"two": two})["two"]
        want = reference(model, tokenizer, [*two.prompt], two)["tokens"]  # type: ignore[misc]
        assert done.error is None and [c.token_ids for c in done.choices] == [want, want]


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_prompts_of_one_to_eight_tokens_run_together(tiny, kind: str) -> None:
    model, tokenizer = tiny
    jobs = _jobs(range(1, 9))
    engine = ENGINES[kind].from_loaded(model, tokenizer, "tiny", max_batch=8, prefill_batch=8)
    _check(tiny, engine, jobs, run_all(engine, jobs))
    # Only one-token prompts, several in one prefill group of an idle engine.
    ones = {f"one{i}": Request(prompt=_prompt(1, i), max_tokens=6) for i in range(3)}
    _check(tiny, engine, ones, run_all(engine, ones))
    # One at a time while the others decode: every length joins a running batch.
    engine = ENGINES[kind].from_loaded(model, tokenizer, "tiny", max_batch=4, prefill_batch=2)
    jobs = _jobs([8, 1, 3, 1, 2, 5, 1, 4], max_tokens=10)
    _check(tiny, engine, jobs, run_all(engine, jobs, join_every=2))


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_a_one_token_prompt_joins_a_batch_mid_decode(tiny, kind: str) -> None:
    model, tokenizer = tiny
    engine = ENGINES[kind].from_loaded(model, tokenizer, "tiny", max_batch=8)
    if kind == "slot":
        engine.joiner.policy = JoinPolicy(0)  # (joins at once, as on the CPU)
    long = {"long": Request(prompt=_prompt(40), max_tokens=24)}
    done: dict[str, Any] = {}
    for key, request in long.items():
        assert engine.add(EngineJob(key, request)) is None
    for _ in range(5):
        done.update({c.key: c for c in engine.step()})
    assert not done  # still decoding when the short one joins
    one = {"one": Request(prompt=_prompt(1), max_tokens=8)}
    assert engine.add(EngineJob("one", one["one"])) is None
    done.update(run_all(engine, {}))
    _check(tiny, engine, {**long, **one}, done)


@pytest.mark.parametrize("cuda_defaults", [False, True], ids=["cpu-choices", "cuda-choices"])
def test_one_token_prompts_with_the_gpu_choices_and_a_prefix_cache(
    tiny, monkeypatch: pytest.MonkeyPatch, cuda_defaults: bool
) -> None:
    """Bucketed prefill shapes, the compiled forward and overlapped steps (the CUDA
    defaults), and a prefix cache: a lone one-token job still allocates the cache."""
    model, tokenizer = tiny
    # Each setting named either way, so the case runs the same on any backend.
    for env in (slot_choices.BUCKETS_ENV, slot_choices.COMPILE_ENV, slot_choices.OVERLAP_ENV):
        monkeypatch.setenv(env, "1" if cuda_defaults else "0")
    engine = SlotEngine.from_loaded(
        model, tokenizer, "tiny", max_batch=4, prefix_cache_bytes=1 << 22
    )
    assert engine.choices.compiled is cuda_defaults
    for n in (1, 2, 1):
        jobs = _jobs([n])
        _check(tiny, engine, jobs, run_all(engine, jobs))
    jobs = _jobs(range(1, 6))
    _check(tiny, engine, jobs, run_all(engine, jobs, join_every=1))


class LongPrefillFails(FlakyModel):
    """A model whose prefill calls of more than ``limit`` positions fail (out of memory,
    as a prompt too big for the device's memory would); shorter calls and decode run."""

    def __init__(self, model: Any, limit: int) -> None:
        super().__init__(model)
        self.limit, self.calls = limit, []

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(tuple(inputs.shape))
        self.fail = inputs.shape[1] > self.limit
        return super().__call__(inputs, *args, **kwargs)


@pytest.mark.parametrize("streams", ["1", "2"])
def test_a_failed_prefill_fails_only_the_job_at_fault(tiny, monkeypatch, streams) -> None:
    """A prefill group of three fails (one prompt too long for the model): the rows
    decoding meanwhile go on, the group's jobs are prefilled again one by one, and only
    the long one ends in error; the others' tokens equal mlx-lm's. The same where the
    group's prefill is split over two CPU streams (its first part fails there)."""
    monkeypatch.setenv(STREAMS_ENV, streams)
    model, tokenizer = tiny
    flaky = LongPrefillFails(model, limit=40)
    engine = SlotEngine.from_loaded(flaky, tokenizer, "tiny", max_batch=8, prefill_batch=4)
    engine.joiner.policy = JoinPolicy(0)
    running = {"running": Request(prompt=_prompt(12), max_tokens=30)}
    assert engine.add(EngineJob("running", running["running"])) is None
    done: dict[str, Any] = {}
    for _ in range(3):
        done.update({c.key: c for c in engine.step()})
    group = {f"p{n}": Request(prompt=_prompt(n), max_tokens=8) for n in (20, 1, 60)}
    before = len(flaky.calls)
    for key, request in group.items():
        assert engine.add(EngineJob(key, request)) is None
    done.update(run_all(engine, {}))
    long = group.pop("p60")
    assert done["p60"].finish_reason == "error" and long.max_tokens == 8
    assert "could not start the job" in done["p60"].error
    assert "out of memory" in done["p60"].error
    _check(tiny, engine, {**running, **group}, done)
    # The group's first prefill call: all three padded to the longest (59 tokens: its
    # prompt less the last); split, its first part is the 20-token prompt alone.
    first = next(s for s in flaky.calls[before:] if s[1] > 1)
    assert first == ((3, 59) if streams == "1" else (1, 59)), "never prefilled together"
    assert engine.batch.cache.free_slots == 8 and not engine.active


def _one_token_text(model_dir: Path) -> str:
    """A text the model's tokenizer makes one token of (BOS included, as mlxq encodes)."""
    from mlx_lm.utils import load_tokenizer

    from mlxq.engine.prompts import PromptEncoder

    tokenizer = load_tokenizer(model_dir)
    encoder = PromptEncoder(tokenizer, None)  # type: ignore[arg-type]
    for text in ("Hi", "a", tokenizer.bos_token or ""):
        if text and len(encoder.prompt_tokens(Request(prompt=text))) == 1:
            return text
    pytest.skip("no one-token text found for this tokenizer")


@pytest.mark.parametrize("engine", ["slot", "batch_generator"])
def test_mlxq_run_with_a_one_token_prompt_alone(tmp_path, tiny_model_dir, engine: str) -> None:
    """End to end: ``mlxq run`` with one line whose prompt is one token, alone."""
    text = _one_token_text(tiny_model_dir)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "one", "prompt": text, "max_tokens": 8}) + "\n")
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}  # an embedded Valkey
    args = ("run", str(src), "--model", str(tiny_model_dir), "-o", str(out))
    run = run_mlxq(*args, "--max-batch", "8", "--engine", engine, env=env)
    assert run.returncode == 0, run.stderr
    (row,) = map(json.loads, out.read_text().splitlines())
    assert row["error"] is None, row["error"]
    assert row["usage"]["prompt_tokens"] == 1
    assert row["finish_reason"] in ("length", "stop")
    n = len(row["token_ids"])
    assert n == 8 if row["finish_reason"] == "length" else n < 8
