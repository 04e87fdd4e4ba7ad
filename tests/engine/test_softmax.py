"""The attention's softmax through powers of two (mlxq.engine.slots.softmax): MLX's softmax
within a unit or two in the last place, the causal attention MLX composes, the engine's
choice per backend, and mlx-lm's greedy tokens through the engine with it; the same two
for the MLP's SiLU through powers of two (mlxq.engine.slots.silu; its own: test_silu.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_reference import reference, run_all

from mlxq.engine.slots.attention import KERNEL_ENV
from mlxq.engine.slots.causal_blocks import BLOCK_ENV
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.slots.joins import JoinPolicy
from mlxq.engine.slots.silu import SILU_ENV, choose_silu
from mlxq.engine.slots.softmax import (
    SOFTMAX_ENV,
    SOFTMAXES,
    Softmax,
    causal_attention,
    choose_softmax,
    mlx_softmax,
    pow2_minus,
    pow2_softmax,
)
from mlxq.wire import Request


def _weights(softmax: Softmax, scores: mx.array, mask: mx.array) -> mx.array:
    """The softmax's weights of ``scores`` (scaled as its queries would be)."""
    return softmax.attend(scores * softmax.query_scale(1.0), mask, lambda w: w)


def test_pow2_softmax_is_mlx_s_within_1e_6() -> None:
    """Scores of both signs and sizes, the first positions masked: the weights within
    1e-6 of MLX's (scaled to powers of two, a score of 30 rounds to within 1e-6, as in
    MLX's Metal attention, which also scales by log2 e), zero where masked, rows summing
    to 1."""
    mx.random.seed(0)
    scores = mx.random.normal((64, 3, 3, 160)) * 8
    mask = mx.arange(160) >= 8
    got, want = _weights(pow2_softmax, scores, mask), _weights(mlx_softmax, scores, mask)
    assert mx.abs(got - want).max().item() <= 1e-6
    assert mx.all(got[..., :8] == 0).item()
    assert mx.allclose(got.sum(axis=-1), mx.ones(got.shape[:-1]), atol=1e-6).item()


def test_pow2_minus_over_the_range_a_softmax_meets() -> None:
    """``2 ** (x - top)`` from 1 down to where float32 underflows, within 3e-7 of
    ``mx.power``'s (a unit or two in the last place; 1e-37 where it nears float32's
    smallest normal), 0 below."""
    x = mx.concatenate([mx.linspace(-126.0, 0.0, 100_001), mx.array([-200.0, -1e30])])
    got = pow2_minus(x, mx.array(0.0))
    want = mx.power(2.0, x)
    assert (mx.abs(got - want) <= 3e-7 * want + 1e-37).all().item()
    assert got[-2:].tolist() == [0.0, 0.0]


def test_pow2_softmax_keeps_a_16_bit_dtype() -> None:
    scores = (mx.random.normal((4, 40)) * 4).astype(mx.bfloat16)
    got = _weights(pow2_softmax, scores, mx.array(True))
    assert got.dtype == mx.bfloat16
    want = _weights(mlx_softmax, scores, mx.array(True)).astype(mx.float32)
    assert mx.allclose(got.astype(mx.float32), want, atol=1e-2).item()


def test_a_row_masked_whole_gives_finite_weights() -> None:
    scores = mx.random.normal((2, 3, 6))
    mask = mx.array([[False] * 6, [True] * 6])[:, None, :]
    for softmax in SOFTMAXES.values():
        assert mx.isfinite(_weights(softmax, scores, mask)).all().item(), softmax.name


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


@pytest.mark.parametrize(
    ("choose", "env"), [(choose_softmax, SOFTMAX_ENV), (choose_silu, SILU_ENV)]
)
def test_softmax_and_silu_settings(monkeypatch, choose, env) -> None:
    monkeypatch.delenv(env, raising=False)
    assert choose("cpu") == "pow2"
    assert choose("cuda") == "mlx" and choose("metal") == "mlx"
    monkeypatch.setenv(env, "mlx")
    assert choose("cpu") == "mlx"
    monkeypatch.setenv(env, "exp")
    with pytest.raises(ValueError, match=f"{env}='exp': choose one of pow2, mlx"):
        choose("cpu")


@pytest.mark.parametrize("name", ["pow2", "mlx"])
@pytest.mark.parametrize("env", [SOFTMAX_ENV, SILU_ENV])
def test_the_engine_gives_mlx_lm_s_tokens_with_either_softmax_or_silu(
    tiny, monkeypatch, env, name
) -> None:
    """Jobs of 1-200 prompt tokens joining a step apart (decode over rows of different
    spans, prefill in blocks on two streams), the attention's softmax or the MLP's SiLU
    (mlxq.engine.slots.silu) through powers of two or MLX's: mlx-lm's greedy tokens."""
    monkeypatch.setenv(env, name)
    engine = SlotEngine.from_loaded(*tiny, "tiny", max_batch=8)
    engine.joiner.policy = JoinPolicy(0)
    assert (engine.choices.softmax if env == SOFTMAX_ENV else engine.choices.silu) == name
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
