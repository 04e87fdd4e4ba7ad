"""The slot engine's compiled decode forward (the CUDA default): it retraces as the cache
grows, takes the model's lazily built arrays as constants, feeds steady steps their last
tokens as they are, gives way to the eager forward when it cannot trace, and keeps going
after an error outside the trace; always with mlx-lm's tokens."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import mlx.core as mx
import pytest
from engine_reference import REQUESTS, check_against_reference, reference, run_all

from mlxq.engine.sampling import EngineJob
from mlxq.engine.slots import batch as slot_batch
from mlxq.engine.slots import choices as slot_choices
from mlxq.engine.slots import step as slot_step
from mlxq.engine.slots.attention import gqa_decode
from mlxq.engine.slots.cache import SlotCache, SlotLayer
from mlxq.engine.slots.compiled import CompiledForward
from mlxq.engine.slots.engine import SlotEngine
from mlxq.wire import Request


class _GrowingCache(SlotCache):
    """A slot cache that grows in steps of one span (32 positions) and records each size."""

    sizes: ClassVar[list[int]] = []

    def __init__(self, num_layers: int, slots: int, **options: Any) -> None:
        super().__init__(num_layers, slots, step=1, **options)

    def reserve(self, tokens: int) -> None:
        super().reserve(tokens)
        if self.capacity not in self.sizes:
            self.sizes.append(self.capacity)


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_compiled_forward_equals_single_requests_as_the_cache_grows(
    tiny, monkeypatch: pytest.MonkeyPatch, compiled: str
) -> None:
    """The compiled decode forward (the CUDA default) retraces as capacity grows, and
    gives the same tokens as the eager one."""
    model, tokenizer = tiny
    monkeypatch.setenv(slot_choices.COMPILE_ENV, compiled)
    monkeypatch.setattr(slot_batch, "SlotCache", _GrowingCache)
    monkeypatch.setattr(_GrowingCache, "sizes", [])
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=4, prefill_batch=2)
    assert engine.choices.compiled is (compiled == "1")
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, 2)
    check_against_reference(tiny, engine, done)
    assert len(_GrowingCache.sizes) >= 3  # it grew while rows decoded


def test_the_compiled_forward_takes_lazily_built_model_arrays_as_constants() -> None:
    """mlx-lm's su-scaled (and Llama 3) RoPE build their frequencies lazily at init, as
    non-parameters: the trace must take them as they are, not redo ``base ** (i / d)``
    in every step's graph."""
    import io
    import re

    from mlxq.engine.models import mlx_lm_seam
    from mlxq.engine.models.make import build_model

    model, _ = build_model("tiny-phi3")
    mlx_lm_seam.install(model)
    cache = SlotCache(len(model.layers), 2)
    heads, dim = model.args.num_key_value_heads, 16
    for layer in range(cache.num_layers):
        kv = mx.zeros((2, heads, 4, dim))
        cache.write([0, 1], layer, kv, kv)
    forward = CompiledForward(model, cache, gqa_decode)
    logits = forward(mx.array([1, 2]), mx.array([4, 4]))
    dot = io.StringIO()
    mx.export_to_dot(dot, logits)
    primitives = set(re.findall(r'label ="([A-Za-z]+)', dot.getvalue()))
    assert "Matmul" in primitives  # (fused elementwise ops show as "Compiled...Power...")
    assert not [p for p in primitives if "Power" in p], primitives


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_steady_steps_feed_the_last_tokens_as_they_are(
    tiny, monkeypatch: pytest.MonkeyPatch, compiled: str
) -> None:
    """A step over the same rows as the last one takes its sampled tokens as inputs,
    without gathering them slot by slot (host work and kernels on every step)."""
    monkeypatch.setenv(slot_choices.COMPILE_ENV, compiled)
    gathered = []
    real = slot_step._gathered_inputs
    monkeypatch.setattr(slot_step, "_gathered_inputs", lambda *a: gathered.append(1) or real(*a))
    model, tokenizer = tiny
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=4, prefill_batch=4)
    jobs = {str(i): Request(prompt=[5 + i, 6, 7], max_tokens=10) for i in range(4)}
    done = run_all(engine, jobs)
    assert all(len(c.token_ids) == 10 or c.finish_reason == "stop" for c in done.values())
    assert engine.stats().decode_steps >= 9 and len(gathered) <= 2


def test_a_forward_that_cannot_be_compiled_gives_way_to_the_eager_one(
    tiny, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A step the tracer cannot follow (here a host read inside each layer: fine eagerly,
    an error while tracing) falls back to the eager forward with one warning; the cache
    is left intact, so the tokens still equal mlx-lm's."""
    monkeypatch.setenv(slot_choices.COMPILE_ENV, "1")
    original = SlotLayer.update_and_fetch

    def reads_the_host(self: SlotLayer, keys: mx.array, values: mx.array) -> Any:
        keys.sum().item()
        return original(self, keys, values)

    monkeypatch.setattr(SlotLayer, "update_and_fetch", reads_the_host)
    model, tokenizer = tiny
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=4, prefill_batch=2)
    assert engine.choices.compiled
    with caplog.at_level(logging.WARNING, logger="mlxq.engine"):
        done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, 2)
    check_against_reference(tiny, engine, done)
    assert not engine.choices.compiled and engine.batch.forward is None
    warned = [r for r in caplog.records if "compiled decode forward failed" in r.getMessage()]
    assert len(warned) == 1


def test_an_error_outside_the_trace_fails_the_batch_and_keeps_the_compiled_forward(
    tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a failed trace drops the compiled forward: the cache failing to grow (out of
    memory) fails the batch as in the eager engine, and later jobs still run compiled."""
    monkeypatch.setenv(slot_choices.COMPILE_ENV, "1")
    model, tokenizer = tiny
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=2, prefill_batch=2)
    for i in range(2):
        engine.add(EngineJob(str(i), REQUESTS[i]))
    engine.step()
    grow = SlotCache.reserve

    def out_of_memory(self: SlotCache, tokens: int) -> None:
        raise RuntimeError("[metal::malloc] Attempting to allocate 99 GB")

    monkeypatch.setattr(SlotCache, "reserve", out_of_memory)
    failed = engine.step()
    monkeypatch.setattr(SlotCache, "reserve", grow)
    assert sorted(c.key for c in failed) == ["0", "1"]
    assert all(c.finish_reason == "error" and "out of memory" in c.error for c in failed)
    assert engine.choices.compiled and engine.batch.forward is not None
    done = run_all(engine, {"2": REQUESTS[2]})
    want = reference(model, tokenizer, engine.encode(REQUESTS[2]), REQUESTS[2])["tokens"]
    assert done["2"].token_ids == want


def test_each_cache_shape_is_traced_once_and_the_copies_are_counted(
    tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``forward_traces`` counts the compiled forward's traces: one per cache shape it
    ran at, and none for a shape it ran at before, so a second batch like the first (the
    cache released between them) traces nothing, as a long-lived worker traces a shape
    once. ``cache_copies`` counts the cache's new layouts, with their seconds."""
    monkeypatch.setenv(slot_choices.COMPILE_ENV, "1")
    monkeypatch.setattr(slot_batch, "SlotCache", _GrowingCache)
    monkeypatch.setattr(_GrowingCache, "sizes", [])
    shapes: set[tuple[int, int]] = set()
    call = CompiledForward.__call__

    def recording(self: CompiledForward, tokens: mx.array, positions: mx.array) -> mx.array:
        shapes.add((self._cache.rows, self._cache.capacity))
        return call(self, tokens, positions)

    monkeypatch.setattr(CompiledForward, "__call__", recording)
    model, tokenizer = tiny
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=4, prefill_batch=2)
    jobs = dict(enumerate(REQUESTS))
    first_done = run_all(engine, {f"a{i}": r for i, r in jobs.items()}, 2)
    first = engine.stats()
    assert first.forward_traces == len(shapes) >= 3
    assert first.cache_copies >= 2 and first.cache_copy_seconds > 0
    assert engine.batch.cache.rows == 0  # (released: the next batch allocates anew)
    again_done = run_all(engine, {f"b{i}": r for i, r in jobs.items()}, 2)
    again = engine.stats().since(first)
    assert again.forward_traces == 0 and again.cache_copies == first.cache_copies
    assert [c.token_ids for c in again_done.values()] == [c.token_ids for c in first_done.values()]
