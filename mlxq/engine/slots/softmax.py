"""The attention's softmax where mlxq composes the attention: through powers of two on the CPU.

MLX's CPU ``exp`` (and ``mx.softmax``, built on it) is slow (:mod:`~mlxq.engine.pow2`); the
attention's softmax is the largest part of a CPU decode step's attention and of a long
prompt's prefill (bench/RESULTS.md). ``pow2`` takes ``exp(s - max)`` as ``2 ** (y - max)``
with the scores ``y = s * log2(e)`` (the queries carry the factor, see
:meth:`Softmax.query_scale`), through :func:`~mlxq.engine.pow2.power`. Two more passes are
saved: the mask is added as a bias, not selected with ``mx.where`` (4x faster on the CPU),
and the weights are divided by their sum after they weigh the values (a row's output, not
its every position). The weights are within 1e-6 of ``mx.softmax``'s at scores up to 30
(scaled into powers of two they round once more, as in MLX's Metal attention, which
scales the same way); the tests hold mlx-lm's tokens.

It applies where mlxq builds the attention from MLX operations: the ``gqa`` decode kernels
(:mod:`~mlxq.engine.slots.attention`) and the prefill's blocks
(:mod:`~mlxq.engine.slots.causal_blocks`). ``MLXQ_SOFTMAX``: ``pow2`` (the CPU's default)
or ``mlx`` (``mx.softmax``, elsewhere's default: a GPU runs it as one fused kernel).

Measured, ``attend`` holds up to four arrays of the scores' size beyond its input, where
MLX's softmax works in place; the prefill's blocks run one after another on a stream, so
that is one block's worth. :func:`warm_up` builds every kernel before its first use in a
process, one process at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlxq.engine.pow2 import LOG2E, choose, power, warm_once

SOFTMAX_ENV = "MLXQ_SOFTMAX"
MASKED = -1e30  # a masked score: finite, so exp() underflows to 0 without inf - inf = NaN

Output = Callable[[mx.array], mx.array]


def _below(x: mx.array, top: mx.array) -> mx.array:
    """``y = x - top``, floored at -127, whose power of two has no exponent bits: 0."""
    return mx.maximum(x - top, -127.0)


# Shapeless: a decode step's shapes change every step, and each traced shape would be kept.
_below_c = mx.compile(_below, shapeless=True)


def pow2_minus(x: mx.array, top: mx.array) -> mx.array:
    """``2 ** (x - top)`` of float32 ``x`` for ``x <= top``, ``top`` one number a row of the
    last axis (module docstring)."""
    # As rows of a matrix: MLX builds a kernel per layout, and these are the four
    # :func:`warm_up` builds (many or one row, many or one position).
    shape = x.shape
    return power(_below_c(x.reshape(-1, shape[-1]), top.reshape(-1, 1))).reshape(shape)


def warm_up() -> None:
    """Build the kernels :func:`pow2_minus` evaluates, once a process, one process at a
    time (:func:`~mlxq.engine.pow2.warm_once`): one for each layout of its matrix, many
    rows or one (a single maximum), many positions or one."""
    warm_once("softmax", _build)


def _build() -> None:
    for shape in ((2, 3), (1, 3), (2, 1), (1, 1)):
        x = mx.zeros(shape, mx.float32)
        mx.eval(pow2_minus(x, x.max(axis=-1, keepdims=True)))


@dataclass(frozen=True)
class Softmax:
    """One way to turn the attention's masked scores into its output."""

    name: str
    base2: bool  # scores in powers of two, through pow2_minus; else MLX's softmax

    def query_scale(self, scale: float) -> float:
        """What the queries are multiplied by for :meth:`attend`'s scores: the attention's
        ``scale``, times ``log2(e)`` where the softmax takes powers of two."""
        return scale * LOG2E if self.base2 else scale

    def attend(self, scores: mx.array, mask: mx.array, output_of: Output) -> mx.array:
        """``output_of(softmax(scores))`` over the positions ``mask`` keeps (``mask``
        broadcasts against ``scores``; masked positions weigh 0), the scores from queries
        scaled by :meth:`query_scale`. The softmax accumulates in float32; the weights
        reach ``output_of`` in the scores' dtype."""
        if not self.base2:
            fill = max(MASKED, mx.finfo(scores.dtype).min)  # (float16's range ends sooner)
            masked = mx.where(mask, scores, mx.array(fill, scores.dtype))
            return output_of(mx.softmax(masked, axis=-1, precise=True))
        warm_up()
        # The bias is the mask's size, the scores' head count times smaller.
        x = scores.astype(mx.float32) + mx.where(mask, 0.0, MASKED)
        weights = pow2_minus(x, x.max(axis=-1, keepdims=True))
        total = weights.sum(axis=-1, keepdims=True).astype(scores.dtype)
        return output_of(weights.astype(scores.dtype)) / total


mlx_softmax = Softmax("mlx", base2=False)
pow2_softmax = Softmax("pow2", base2=True)
SOFTMAXES: dict[str, Softmax] = {s.name: s for s in (pow2_softmax, mlx_softmax)}


def choose_softmax(backend: str) -> str:
    """The softmax's name on ``backend`` (module docstring); raises ``ValueError`` for a
    setting that names none."""
    return choose(SOFTMAX_ENV, backend, SOFTMAXES)


def causal_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, softmax: Softmax
) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(..., mask="causal")`` as MLX composes it off
    its fused kernels (``mlx/fast.cpp``), with ``softmax``: the last query sees every key,
    and each earlier one a key fewer."""
    batch, heads, rows, dim = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    q = (queries * mx.array(softmax.query_scale(scale), queries.dtype)).reshape(
        batch, kv_heads, heads // kv_heads, rows, dim
    )
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    seen = mx.arange(span - rows, span)[:, None] >= mx.arange(span)[None]
    out = softmax.attend(scores, seen, lambda w: w @ mx.expand_dims(values, 2))
    return out.reshape(batch, heads, rows, dim)
