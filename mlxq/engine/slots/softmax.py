"""The attention's softmax where mlxq composes the attention: through powers of two on the CPU.

MLX's CPU ``exp`` (and ``mx.softmax``, built on it) took 13-18 ns an element here, on one
thread a stream, where ``mx.power(2, x)`` took 4.4-7.3 ns; the attention's softmax is the
largest part of a CPU decode step's attention and of a long prompt's prefill
(bench/RESULTS.md). :func:`pow2_softmax` computes ``exp(x - max)`` as
``2 ** ((x - max) * log2(e))``: 1.9-2.5x faster than ``mx.softmax`` at the engine's
shapes, its weights within 1.2e-7 of ``mx.softmax``'s (a float32 unit in the last place or
two of a weight up to 1), the size of difference the prefill's blocks already make.

It applies where mlxq builds the attention from MLX operations: the ``gqa`` decode kernels
(:mod:`~mlxq.engine.slots.attention`) and the prefill's blocks
(:mod:`~mlxq.engine.slots.causal_blocks`). ``MLXQ_SOFTMAX``: ``pow2`` (the CPU's default)
or ``mlx`` (``mx.softmax``, elsewhere's default: a GPU runs it as one fused kernel).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import mlx.core as mx

SOFTMAX_ENV = "MLXQ_SOFTMAX"
LOG2E = 1 / math.log(2)

Softmax = Callable[[mx.array], mx.array]


def pow2_softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, ``exp`` taken as a power of two (module docstring),
    computed in float32 and returned in the scores' dtype."""
    x = scores.astype(mx.float32)
    e = mx.power(2.0, (x - x.max(axis=-1, keepdims=True)) * LOG2E)
    return (e / e.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def mlx_softmax(scores: mx.array) -> mx.array:
    """MLX's own softmax over the last axis, accumulated in float32."""
    return mx.softmax(scores, axis=-1, precise=True)


SOFTMAXES: dict[str, Softmax] = {"pow2": pow2_softmax, "mlx": mlx_softmax}


def choose_softmax(backend: str) -> str:
    """The softmax's name on ``backend`` (module docstring); raises ``ValueError`` for a
    setting that names none."""
    name = os.environ.get(SOFTMAX_ENV) or ("pow2" if backend == "cpu" else "mlx")
    if name not in SOFTMAXES:
        raise ValueError(f"{SOFTMAX_ENV}={name!r}: choose one of {', '.join(SOFTMAXES)}")
    return name


def causal_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, softmax: Softmax
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(..., mask="causal")`` as MLX composes it off
    its fused kernels (``mlx/fast.cpp``), with ``softmax``: the last query sees every key,
    and each earlier one a key fewer."""
    batch, heads, rows, dim = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    q = (queries * mx.array(scale, queries.dtype)).reshape(
        batch, kv_heads, heads // kv_heads, rows, dim
    )
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    seen = mx.arange(span - rows, span)[:, None] >= mx.arange(span)[None]
    scores = mx.where(seen, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    out = softmax(scores) @ mx.expand_dims(values, 2)
    return out.reshape(batch, heads, rows, dim)
