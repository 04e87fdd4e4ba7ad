"""The attention's softmax through powers of two (mlxq.engine.slots.softmax): MLX's softmax
within a unit or two in the last place, the causal attention MLX composes, the engine's
choice per backend, and mlx-lm's greedy tokens through the engine with it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_reference import reference, run_all

from mlxq.engine.slots.attention import KERNEL_ENV
from mlxq.engine.slots.causal_blocks import BLOCK_ENV
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.slots.joins import JoinPolicy
from mlxq.engine.slots.softmax import (
    SOFTMAX_ENV,
    SOFTMAXES,
    causal_attention,
    choose_softmax,
    mlx_softmax,
    pow2_softmax,
)
from mlxq.wire import Request


def test_pow2_softmax_is_mlx_s_within_a_unit_or_two_in_the_last_place() -> None:
    """Scores of both signs and sizes, a masked entry of each kind the attention uses:
    the weights within 2.4e-7 of MLX's, zero where masked, rows summing to 1."""
    mx.random.seed(0)
    scores = mx.random.normal((64, 3, 3, 160)) * 8
    scores[..., :7] = -1e30  # (the decode's mask)
    scores[..., 7] = mx.finfo(mx.float32).min  # (MLX's causal mask)
    got, want = pow2_softmax(scores), mlx_softmax(scores)
    assert mx.abs(got - want).max().item() <= 2.4e-7
    assert mx.all(got[..., :8] == 0).item()
    assert mx.allclose(got.sum(axis=-1), mx.ones(got.shape[:-1]), atol=1e-6).item()


def test_pow2_softmax_keeps_a_16_bit_dtype() -> None:
    scores = (mx.random.normal((4, 40)) * 4).astype(mx.bfloat16)
    got = pow2_softmax(scores)
    assert got.dtype == mx.bfloat16
    assert mx.allclose(
        got.astype(mx.float32), mlx_softmax(scores).astype(mx.float32), atol=1e-2
    ).item()


@pytest.mark.parametrize("name", ["mlx", "pow2"])
@pytest.mark.parametrize(("rows", "span"), [(1, 1), (16, 16), (16, 70), (5, 9)])
def test_causal_attention_is_mlx_s_one_call(name: str, rows: int, span: int) -> None:
    """9 query heads over 3 KV heads, the queries the last ``rows`` of ``span``."""
    mx.random.seed(rows + span)
    q = mx.random.normal((2, 9, rows, 32))
    k, v = (mx.random.normal((2, 3, span, 32)) for _ in range(2))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    got = causal_attention(q, k, v, 0.2, SOFTMAXES[name])
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=2e-6).item()


def test_softmax_settings(monkeypatch) -> None:
    monkeypatch.delenv(SOFTMAX_ENV, raising=False)
    assert choose_softmax("cpu") == "pow2"
    assert choose_softmax("cuda") == "mlx" and choose_softmax("metal") == "mlx"
    monkeypatch.setenv(SOFTMAX_ENV, "mlx")
    assert choose_softmax("cpu") == "mlx"
    monkeypatch.setenv(SOFTMAX_ENV, "exp")
    with pytest.raises(ValueError, match=f"{SOFTMAX_ENV}='exp': choose one of pow2, mlx"):
        choose_softmax("cpu")


@pytest.mark.parametrize("name", ["pow2", "mlx"])
def test_the_engine_gives_mlx_lm_s_tokens_with_either_softmax(tiny, monkeypatch, name) -> None:
    """Jobs of 1-200 prompt tokens joining a step apart (decode over rows of different
    spans, prefill in blocks on two streams): mlx-lm's greedy tokens."""
    monkeypatch.setenv(SOFTMAX_ENV, name)
    engine = SlotEngine.from_loaded(*tiny, "tiny", max_batch=8)
    engine.joiner.policy = JoinPolicy(0)
    assert engine.choices.softmax == name
    jobs = {
        f"p{n}": Request(prompt=[(5 * i + n) % 300 + 3 for i in range(n)], max_tokens=16)
        for n in (200, 1, 57, 130, 9)
    }
    done = run_all(engine, jobs, join_every=1)
    for key, request in jobs.items():
        assert done[key].token_ids == reference(*tiny, request.prompt, request)["tokens"], key


def test_a_softmax_asked_where_nothing_composes_one_is_refused(tiny, monkeypatch) -> None:
    """``pow2`` asked of MLX's fused decode attention with prefill blocks off would go
    unused: refused. The same engine with blocks, or with the softmax left to its default,
    starts."""
    monkeypatch.setenv(KERNEL_ENV, "fused")
    monkeypatch.setenv(BLOCK_ENV, "0")
    monkeypatch.setenv(SOFTMAX_ENV, "pow2")
    with pytest.raises(ValueError, match="MLXQ_SOFTMAX=pow2 applies where mlxq composes"):
        SlotEngine.from_loaded(*tiny, "tiny", max_batch=2)
    monkeypatch.delenv(SOFTMAX_ENV)
    assert SlotEngine.from_loaded(*tiny, "tiny", max_batch=2).choices.attention == "fused"
    monkeypatch.setenv(SOFTMAX_ENV, "pow2")
    monkeypatch.setenv(BLOCK_ENV, "64")
    assert SlotEngine.from_loaded(*tiny, "tiny", max_batch=2).choices.softmax == "pow2"
