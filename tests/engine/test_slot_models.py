"""Model families and quantized slot caches on the slot engine: batched greedy output,
jobs joining and leaving, equals mlx-lm's single requests token for token (eager and
compiled); a family the engine does not handle falls back to ``BatchGenerator``."""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from engine_reference import REQUESTS, check_against_reference, run_all
from mlx_lm.generate import generate_step

from mlxq.engine.factory import make_engine
from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine
from mlxq.engine.slots import choices as slot_choices
from mlxq.engine.slots.cache import SlotCache
from mlxq.engine.slots.engine import SlotEngine


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from mlxq.engine.models.make import make_model

    return mlx_lm.load(str(make_model(tmp_path_factory.mktemp("wide"), "tiny-wide-heads")))


def _quantized_reference(model: Any, tokenizer: Any, tokens: list[int], request, bits: int):
    """mlx-lm's single request with its own quantized KV cache from the first token on."""
    out = []
    steps = generate_step(
        mx.array(tokens),
        model,
        max_tokens=request.max_tokens,
        kv_bits=bits,
        kv_group_size=32,
        quantized_kv_start=0,
    )
    for token, _ in steps:
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


@pytest.mark.parametrize(("bits", "compiled"), [(8, "0"), (4, "0"), (8, "1")])
def test_quantized_slot_cache_equals_mlx_lm_quantized_single_requests(
    wide_heads, monkeypatch: pytest.MonkeyPatch, bits: int, compiled: str
) -> None:
    """With kv_bits, batched greedy output (jobs joining and leaving) equals mlx-lm's
    single-request greedy output over its QuantizedKVCache, token for token (also through
    the compiled forward)."""
    monkeypatch.setenv(slot_choices.COMPILE_ENV, compiled)
    model, tokenizer = wide_heads
    sizes = {"max_batch": 4, "prefill_batch": 2}
    plain = SlotEngine.from_loaded(model, tokenizer, "wide", **sizes)
    engine = SlotEngine.from_loaded(model, tokenizer, "wide", kv_bits=bits, **sizes)
    assert engine.choices.attention == f"{bits}-bit quantized"
    held: dict[int, int] = {}  # each cache's most bytes when dropped (idle)
    release = SlotCache.release

    def dropped(c: SlotCache) -> None:
        held[id(c)] = max(held.get(id(c), 0), c.nbytes)
        release(c)

    monkeypatch.setattr(SlotCache, "release", dropped)
    jobs = {str(i): r for i, r in enumerate(REQUESTS)}
    done, plain_done = run_all(engine, jobs, 2), run_all(plain, jobs, 2)
    for i, request in enumerate(REQUESTS):
        ref = _quantized_reference(model, tokenizer, engine.encode(request), request, bits)
        assert done[str(i)].token_ids == ref, f"request {i}"
    # float32 values, groups of 32 with a float32 scale and bias each.
    per_value = bits / 8 + 2 * 4 / 32
    quantized, full = held[id(engine.batch.cache)], held[id(plain.batch.cache)]
    assert full > 0 and quantized == pytest.approx(full * per_value / 4)
    assert all(c.finish_reason in ("stop", "length") for c in plain_done.values())


def test_kv_bits_that_cannot_be_honoured_are_refused(tiny) -> None:
    model, tokenizer = tiny  # heads of 16 values
    with pytest.raises(ValueError, match="multiple of 32"):
        SlotEngine.from_loaded(model, tokenizer, "tiny", kv_bits=8)
    with pytest.raises(ValueError, match="choose 8 or 4"):
        SlotEngine.from_loaded(model, tokenizer, "tiny", kv_bits=5)
    with pytest.raises(ValueError, match="needs the slot engine"):
        make_engine(model, tokenizer, "tiny", engine="batch_generator", kv_bits=8)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    from mlxq.engine.models.make import make_model

    root = tmp_path_factory.mktemp("families")
    presets = ("tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-phi3", "tiny-gemma3")
    return {p: mlx_lm.load(str(make_model(root / p, p))) for p in presets}


@pytest.mark.parametrize(
    ("preset", "kind"),
    [
        ("tiny-qwen2", SlotEngine),
        ("tiny-qwen3", SlotEngine),
        ("tiny-mistral", SlotEngine),
        ("tiny-phi3", SlotEngine),
        ("tiny-gemma3", BatchGeneratorEngine),  # sliding-window layers: the fallback
    ],
)
def test_model_families_equal_single_requests(
    family_models: dict, preset: str, kind: type, caplog: pytest.LogCaptureFixture
) -> None:
    model, tokenizer = family_models[preset]
    with caplog.at_level(logging.INFO, logger="mlxq.engine"):
        engine = make_engine(model, tokenizer, preset, max_batch=3, prefill_batch=2)
    assert type(engine) is kind
    fallback = [r for r in caplog.records if "BatchGenerator" in r.getMessage()]
    assert len(fallback) == (kind is BatchGeneratorEngine)
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, join_every=2)
    check_against_reference((model, tokenizer), engine, done)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-phi3"])
def test_model_families_through_the_compiled_forward(
    family_models: dict, preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled decode forward (the CUDA default) traces every family on slots."""
    monkeypatch.setenv(slot_choices.COMPILE_ENV, "1")
    model, tokenizer = family_models[preset]
    engine = make_engine(model, tokenizer, preset, max_batch=3, prefill_batch=2)
    assert isinstance(engine, SlotEngine) and engine.choices.compiled
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, join_every=2)
    check_against_reference((model, tokenizer), engine, done)
