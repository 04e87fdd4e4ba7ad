"""The MLP's SiLU through powers of two (mlxq.engine.slots.silu): as close to the exact
value as mlx-lm's, only where the slot engine runs the model (the same model in mlx-lm's
own generation keeps mlx-lm's). Its choice per backend and mlx-lm's greedy tokens through
the engine with it: test_softmax.py, beside the softmax's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from engine_reference import run_all
from mlx_lm.models.activations import swiglu as mlx_swiglu

from mlxq.engine.models import mlx_lm_seam
from mlxq.engine.slots import silu
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.slots.silu import SILU_ENV, pow2_swiglu
from mlxq.wire import Request


def _exact(gate: mx.array, x: mx.array) -> np.ndarray:
    g, u = (np.array(a, dtype=np.float64) for a in (gate, x))
    with np.errstate(over="ignore"):  # (exp(1e4) is infinite: the SiLU 0)
        return g / (1 + np.exp(-g)) * u


def _relative(got: mx.array, exact: np.ndarray) -> float:
    return float(np.max(np.abs(np.array(got, np.float64) - exact) / (np.abs(exact) + 1e-30)))


def test_pow2_swiglu_is_as_close_to_the_exact_value_as_mlx_lm_s() -> None:
    """Gates of both signs up to 16 (a model's are within a few units): within 1e-6 of
    float64's SiLU, relative, as mlx-lm's is; the same shape and dtype."""
    mx.random.seed(0)
    gate, x = mx.random.normal((64, 1, 1536)) * 4, mx.random.normal((64, 1, 1536))
    got, theirs = pow2_swiglu(gate, x), mlx_swiglu(gate, x)
    assert got.shape == theirs.shape and got.dtype == mx.float32
    assert _relative(got, _exact(gate, x)) <= 1e-6
    assert _relative(theirs, _exact(gate, x)) <= 1e-6


def test_pow2_swiglu_past_the_power_s_range_and_at_zero() -> None:
    """Far out the sigmoid is 0 or 1 to float32's precision: large gates pass through,
    very negative ones give (about) zero, never NaN or infinity; 0 gives 0. (Below -16
    the relative error grows with the rounding of ``gate * log2 e``, 1.3e-6 at -30, where
    the value is 3e-12.)"""
    gate = mx.array([-1e4, -200.0, -88.0, -30.0, 0.0, 30.0, 88.0, 200.0, 1e4])
    got = pow2_swiglu(gate, mx.ones_like(gate))
    assert mx.isfinite(got).all().item()
    assert np.allclose(np.array(got), _exact(gate, mx.ones_like(gate)), rtol=1e-5, atol=1e-30)
    assert got[4].item() == 0.0 and got[-1].item() == 1e4


def test_views_give_what_whole_arrays_give() -> None:
    """Columns of a wider array (fused projections hand out views) as the same values
    laid out whole."""
    wide = mx.random.normal((5, 1, 12)) * 3
    gate, x = wide[..., :6], wide[..., 6:]
    assert mx.array_equal(pow2_swiglu(gate, x), pow2_swiglu(mx.array(gate), mx.array(x))).item()


def test_other_dtypes_keep_mlx_lm_s() -> None:
    """The powers of two are a float32 method: bfloat16 and float16 go to mlx-lm's, bit
    for bit."""
    for dtype in (mx.bfloat16, mx.float16):
        gate, x = (mx.random.normal((3, 1, 64)).astype(dtype) for _ in range(2))
        assert mx.array_equal(pow2_swiglu(gate, x), mlx_swiglu(gate, x)).item()


def _counting(monkeypatch) -> list[int]:
    """Counts of pow2_swiglu's calls (the engine reads it from SWIGLUS at start)."""
    calls: list[int] = []

    def counted(gate: mx.array, x: mx.array) -> mx.array:
        calls.append(gate.shape[0])
        return pow2_swiglu(gate, x)

    monkeypatch.setitem(silu.SWIGLUS, "pow2", counted)
    return calls


def test_only_the_engine_s_steps_take_it(tiny, monkeypatch) -> None:
    """The engine's steps call it once a layer; the same model called outside them (as
    mlx-lm's own generation calls it, here after the engine installed itself) calls
    mlx-lm's."""
    monkeypatch.delenv(SILU_ENV, raising=False)
    calls = _counting(monkeypatch)
    model, tokenizer = tiny
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=2)
    assert engine.choices.silu == "pow2"
    run_all(engine, {"a": Request(prompt=[5, 6, 7], max_tokens=3)})
    layers = len(model.layers)
    assert len(calls) >= 3 * layers and len(calls) % layers == 0
    calls.clear()
    mx.eval(model(mx.array([[5, 6, 7]])))
    assert calls == []
    with mlx_lm_seam.activations(None):  # (and a block that chose none: mlx-lm's)
        mx.eval(model(mx.array([[5, 6, 7]])))
    assert calls == []


def test_pow2_asked_of_a_model_without_swiglu_is_refused(tiny, monkeypatch) -> None:
    """Asked for, it would go unused: refused, naming the setting. Left to its default,
    the engine starts with mlx-lm's activations as the model has them."""
    monkeypatch.setattr(mlx_lm_seam, "uses_swiglu", lambda model: False)
    monkeypatch.setenv(SILU_ENV, "pow2")
    with pytest.raises(ValueError, match=f"{SILU_ENV}=pow2 applies to models whose MLP"):
        SlotEngine.from_loaded(*tiny, "tiny", max_batch=2)
    monkeypatch.delenv(SILU_ENV)
    calls = _counting(monkeypatch)
    engine = SlotEngine.from_loaded(*tiny, "tiny", max_batch=2)
    run_all(engine, {"a": Request(prompt=[5, 6, 7], max_tokens=2)})
    assert calls == []


def test_the_seam_sees_the_models_that_call_swiglu(tiny) -> None:
    assert mlx_lm_seam.uses_swiglu(tiny[0])
