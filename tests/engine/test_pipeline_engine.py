"""Rank 0's pipeline engine alone (no other rank: its relay records what it would send):
turns sent ahead with each call once, applied here when their turn runs; outputs equal to
mlx-lm's greedy; a cancel comes out of ``step()``; a key twice is refused. The ranks together:
tests/engine/test_distributed.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from engine_reference import REQUESTS, check_against_reference, run_all

from mlxq.engine.distributed import pipeline
from mlxq.engine.distributed.pipeline import PipelineEngine
from mlxq.engine.sampling import EngineJob
from mlxq.engine.slots.engine import SlotEngine
from mlxq.wire import Request


class Recorder:
    """A relay that keeps the turns rank 0 sends: (micro-batch, calls, token count)."""

    def __init__(self) -> None:
        self.turns: list[tuple[int, list[Any], int]] = []

    def send(self, turn: int, data: bytes, tokens: Any, wait: bool = False) -> None:
        calls = msgspec.msgpack.decode(data, type=list[pipeline.Call])
        self.turns.append((turn, calls, 0 if tokens is None else tokens.size))


@pytest.fixture
def engine(tiny) -> PipelineEngine:
    model, tokenizer = tiny
    engines = [SlotEngine(model, tokenizer, "tiny", max_batch=2) for _ in range(2)]
    return PipelineEngine(engines, Recorder())  # type: ignore[arg-type]


def test_turns_go_ahead_and_outputs_equal_single_requests(tiny, engine: PipelineEngine):
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, join_every=2)
    check_against_reference(tiny, engine, done)
    turns = engine.relay.turns
    assert [t for t, _, _ in turns] == [i % 2 for i in range(len(turns))]  # (taking turns)
    assert len(turns) == engine.steps + 1  # (one turn ahead of this rank: as many as ranks)
    joins = [c for _, calls, _ in turns for c in calls if isinstance(c, pipeline.Join)]
    assert sorted(j.key for j in joins) == sorted(str(i) for i in range(len(REQUESTS)))
    assert {j.batch for j in joins} == {0, 1}  # (both micro-batches used)
    assert sum(n for _, _, n in turns) > 0  # (sampled tokens go with the turns)


def test_a_cancel_comes_out_of_step_and_a_key_twice_is_refused(engine: PipelineEngine):
    assert engine.add(EngineJob("a", Request(prompt=[5, 6, 7], max_tokens=50))) is None
    with pytest.raises(ValueError, match="already in the engine"):  # (queued, not sent)
        engine.add(EngineJob("a", Request(prompt=[5, 6], max_tokens=5)))
    assert engine.active >= 1  # (calls not applied yet count: the runner keeps stepping)
    assert engine.step() == []
    with pytest.raises(ValueError, match="already in the engine"):  # (in a micro-batch)
        engine.add(EngineJob("a", Request(prompt=[5, 6], max_tokens=5)))
    assert engine.cancel("a") is None
    done = []
    while engine.active:
        done += engine.step()
    assert [(c.key, c.finish_reason) for c in done] == [("a", "cancelled")]


def test_the_prefill_batch_reads_as_set_before_it_is_applied(engine: PipelineEngine):
    engine.set_prefill_batch(1)
    assert engine.prefill_batch == 1 and engine.engines[0].prefill_batch != 1
    while engine.active:
        engine.step()
    assert all(e.prefill_batch == 1 for e in engine.engines)


def test_samples_beyond_a_micro_batch_are_refused_with_the_batch_that_holds_them(
    engine: PipelineEngine,
):
    failed = engine.add(EngineJob("n", Request(prompt=[5, 6], max_tokens=4, n=3)))
    assert failed is not None and failed.finish_reason == "error"
    assert "hold 2 each" in (failed.error or "") and "--max-batch 6" in (failed.error or "")
    assert engine.active == 0  # (nothing sent for it)
