"""The MLP's SiLU through powers of two on the CPU, where the slot engine runs the model.

mlx-lm's llama-family MLPs (llama, qwen2, qwen3, mistral, phi3 and more) compute
``down(silu(gate(x)) * up(x))`` through ``swiglu`` (``mlx_lm.models.activations``), whose
sigmoid takes MLX's ``exp``: on the CPU the largest elementwise part of a step, about a
seventh of a decode step (bench/RESULTS.md). :func:`pow2_swiglu`
computes ``gate * x / (1 + 2 ** (-gate * log2 e))`` through
:func:`~mlxq.engine.pow2.power`: as close to the exact value as mlx-lm's (both within
9e-7, relative, of float64), in three compiled kernels. Float32 only: other dtypes keep
mlx-lm's.

The slot engine's steps run under :func:`~mlxq.engine.models.mlx_lm_seam.activations`
with the chosen one, so the same model called elsewhere (mlx-lm's own generation) keeps
mlx-lm's. ``MLXQ_SILU``: ``pow2`` (the CPU's default) or ``mlx`` (elsewhere's default: a
GPU runs mlx-lm's as one fused kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.activations import swiglu as mlx_swiglu

from mlxq.engine.pow2 import LOG2E, choose, power, warm_once

SILU_ENV = "MLXQ_SILU"
Swiglu = Callable[[mx.array, mx.array], mx.array]


def _minus_log2(gate: mx.array) -> mx.array:
    """``-gate * log2(e)`` within :func:`~mlxq.engine.pow2.power`'s range (past it the
    sigmoid is 0 or 1 to float32's precision)."""
    return mx.clip(gate * -LOG2E, -127.0, 127.0)


def _gated(gate: mx.array, x: mx.array, power_of_minus: mx.array) -> mx.array:
    """``silu(gate) * x`` from ``2 ** (-gate * log2 e)``."""
    return (gate * x) / (1.0 + power_of_minus)


_minus_log2_c = mx.compile(_minus_log2, shapeless=True)
_gated_c = mx.compile(_gated, shapeless=True)


def pow2_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``, as mlx-lm's ``swiglu``, through powers of two (float32; other
    dtypes go to mlx-lm's)."""
    if gate.dtype != mx.float32 or x.dtype != mx.float32:
        return mlx_swiglu(gate, x)
    warm_up()
    return _kernels(gate, x)


def _kernels(gate: mx.array, x: mx.array) -> mx.array:
    return _gated_c(gate, x, power(_minus_log2_c(gate)))


def warm_up() -> None:
    """Build the kernels :func:`pow2_swiglu` evaluates, once a process, one process at a
    time: for inputs laid out whole, and for views (fused projections hand out columns),
    which MLX reads as a matrix or, one column wide, a vector."""
    warm_once("silu", _build)


def _build() -> None:
    whole = mx.zeros((2, 1, 3), mx.float32)
    for views in (mx.zeros((2, 1, 6), mx.float32)[..., :3], mx.zeros((2, 1, 2))[..., :1]):
        mx.eval(_kernels(whole, whole), _kernels(views, views))


SWIGLUS: dict[str, Swiglu] = {"pow2": pow2_swiglu, "mlx": mlx_swiglu}


def choose_silu(backend: str) -> str:
    """The SiLU's name on ``backend`` (module docstring); raises ``ValueError`` for a
    setting that names none."""
    return choose(SILU_ENV, backend, SWIGLUS)
