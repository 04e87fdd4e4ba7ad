"""Decode attention over slots: one query per row, keys up to each row's own length.

Three kernels compute the same thing, ``softmax(q K^T * scale + mask) V`` for queries of
shape ``[rows, q_heads, 1, head_dim]`` and keys/values ``[rows, kv_heads, span, head_dim]``,
where ``mask`` (``[rows, 1, 1, span]``, bool) marks each row's valid positions:

- ``"gqa"``: plain MLX ops. The query heads of each KV head are grouped
  (``[rows, kv_heads, group, D] @ K^T``), so K and V are never repeated; the softmax (the
  engine's choice, :mod:`~mlxq.engine.slots.softmax`) accumulates in float32; masked
  positions get a large finite negative, so a row whose mask is all false (never the case
  for a live row) still gives finite numbers. On CUDA, MLX's fused kernel leaves its fast
  path for any array mask, and this one measured faster there (bench/RESULTS.md, "One
  decode step, 256 rows").
- ``"fused"``: ``mx.fast.scaled_dot_product_attention`` with the bool mask; Metal's vector
  kernel takes array masks at full speed.
- ``"ragged"``: mlxq's CUDA kernel (:mod:`~mlxq.engine.slots.ragged_attention`), which
  reads only unmasked positions in one launch a layer: the CUDA default where the head
  size is a multiple of 64 (about 2x faster attention than ``gqa`` on the H200 at 1,024
  rows of varied lengths; bench/RESULTS.md).

A quantized slot cache (``kv_bits``) always uses :func:`quantized_decode`, the first
kernel over ``mx.quantized_matmul``.

:func:`choose_kernel` picks one per backend once at start (``MLXQ_DECODE_ATTENTION``
overrides: ``gqa``, ``gqa-compiled``, ``fused`` or ``ragged``) and the engine logs the choice.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import mlx.core as mx

from mlxq.engine.scheduler import kv_group_size
from mlxq.engine.slots import ragged_attention
from mlxq.engine.slots.softmax import Softmax, mlx_softmax

log = logging.getLogger("mlxq.engine.slots.engine")

# (queries, keys, values, scale, mask): keys and values are arrays, or quantized parts.
Kernel = Callable[..., mx.array]
KERNEL_ENV = "MLXQ_DECODE_ATTENTION"
# Per backend: CUDA's fused kernel is slow with array masks (mlxq's ragged one reads only
# each row's positions); Metal's takes them at full speed (its vector kernel). On the CPU
# the grouped one measured 1.09-1.29x faster end to end (cpu-small, batch 32, varied
# outputs; 1.08x on their uniform twin).
DEFAULT_KERNEL = {"cuda": "ragged", "metal": "fused", "cpu": "gqa"}


def _grouped(
    q: mx.array,
    kv_heads: int,
    scale: float,
    mask: mx.array,
    scores_of: Callable[[mx.array], mx.array],
    output_of: Callable[[mx.array], mx.array],
    softmax: Softmax,
) -> mx.array:
    """The query heads of each KV head grouped, ``scores_of(queries)`` masked and softmaxed,
    then ``output_of(weights)``: the two matmuls are the caller's (plain or quantized)."""
    rows, q_heads, _, dim = q.shape
    # Scale the small query, not the scores; the scores come out of the matmul in the
    # model's dtype either way, and the softmax accumulates in float32.
    qg = (q * softmax.query_scale(scale)).reshape(rows, kv_heads, q_heads // kv_heads, dim)
    out = softmax.attend(scores_of(qg), mask, output_of)  # (scores: [rows, kv, group, span])
    return out.reshape(rows, q_heads, 1, dim)


def gqa_decode(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array,
    softmax: Softmax = mlx_softmax,
) -> mx.array:
    """Grouped-query attention for one query per row (see the module docstring), with
    ``softmax`` (:mod:`~mlxq.engine.slots.softmax`)."""
    return _grouped(
        q, k.shape[1], scale, mask, lambda qg: qg @ k.swapaxes(-1, -2), lambda w: w @ v, softmax
    )


def quantized_decode(
    q: mx.array,
    k: tuple[mx.array, ...],
    v: tuple[mx.array, ...],
    scale: float,
    mask: mx.array,
    group_size: int,
    bits: int,
    softmax: Softmax = mlx_softmax,
) -> mx.array:
    """:func:`gqa_decode` over a quantized cache (``mx.quantize`` parts of keys and values):
    ``mx.quantized_matmul`` reads them without a dequantized copy, as mlx-lm's quantized
    attention does."""
    opts = {"group_size": group_size, "bits": bits}
    return _grouped(
        q,
        k[0].shape[1],
        scale,
        mask,
        lambda qg: mx.quantized_matmul(qg, *k, transpose=True, **opts),
        lambda w: mx.quantized_matmul(w, *v, transpose=False, **opts),
        softmax,
    )


def fused_decode(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    """MLX's fused attention with a bool mask of each row's valid positions."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def ragged_or_gqa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    """The ragged kernel, or :func:`gqa_decode` for a model whose group of query heads per
    KV head is too wide for one of its blocks (logged once)."""
    group, dim = q.shape[1] // k.shape[1], q.shape[-1]
    if ragged_attention.fits(group, dim):
        return ragged_attention.ragged_decode(q, k, v, scale, mask)
    _too_wide(group, dim)
    return gqa_decode(q, k, v, scale, mask)


@functools.cache
def _too_wide(group: int, dim: int) -> None:
    log.warning(
        "the ragged decode attention cannot hold %d query heads of %d values per KV head: "
        "this model attends with gqa",
        group,
        dim,
    )


KERNELS: dict[str, Kernel] = {
    "gqa": gqa_decode,
    # The same, through mx.compile (fuses the cast, scale and mask into one kernel; traced
    # once per shape): an option to measure, not a default.
    "gqa-compiled": mx.compile(gqa_decode),
    "fused": fused_decode,
    "ragged": ragged_or_gqa,
}


def choose_kernel(
    backend: str, override: str | None = None, head_dim: int = 64
) -> tuple[str, Kernel]:
    """The decode attention for this backend: ``override``, else the environment, else
    :data:`DEFAULT_KERNEL` (``gqa`` where ``ragged`` cannot run heads of ``head_dim``).
    Raises ``ValueError`` for an unknown name, or ``ragged`` asked for where it cannot run."""
    asked = override or os.environ.get(KERNEL_ENV)
    name = asked or DEFAULT_KERNEL.get(backend, "fused")
    if name not in KERNELS:
        raise ValueError(
            f"unknown decode attention {name!r} (from {KERNEL_ENV} or the engine options): "
            f"choose one of {', '.join(KERNELS)}"
        )
    if name == "ragged" and not (backend == "cuda" and ragged_attention.supported(head_dim)):
        if asked:
            raise ValueError(
                f"the ragged decode attention needs CUDA and heads of a multiple of 64 "
                f"values (this model's have {head_dim}, on {backend}): choose gqa or fused"
            )
        name = "gqa"
    return name, KERNELS[name]


KV_BITS = (8, 4)


def quantized_kernel(bits: int, head_dim: int) -> tuple[int, Kernel]:
    """``(group_size, kernel)`` for a slot cache quantized to ``bits``; raises
    ``ValueError`` for other bits or a head too narrow to quantize (groups of 64, else 32)."""
    if bits not in KV_BITS:
        raise ValueError(f"kv_bits {bits} is not supported: choose 8 or 4")
    group = kv_group_size(head_dim)
    if group is None:
        raise ValueError(
            f"a quantized KV cache needs heads of a multiple of 32 values; this model's "
            f"have {head_dim}: run it without kv_bits"
        )
    return group, functools.partial(quantized_decode, group_size=group, bits=bits)
