"""A prefill's causal attention in blocks of query rows, so that the masked half is skipped.

On the CPU, MLX's ``scaled_dot_product_attention`` is composed of plain operations: a
chunk's whole square of scores is computed and exponentiated (MLX's CPU ``exp`` runs at
about 12 ns an element, on one thread), and then the causal half is masked. The prefill's
temporary cache layers here (:class:`BlockedCache`) attend a chunk's queries ``block`` rows
at a time instead, each block over the keys up to its own last row: the same causal
attention, about half the work on a long prompt (a 1,480-token prompt prefilled 1.6x
faster on the real model, bench/RESULTS.md). Each query weighs the same keys as in the
square (the masked ones weigh exactly 0); only how the float sums group changes, as a
row's right-padding already changes it. Split over two CPU streams
(:mod:`~mlxq.engine.slots.prefill_streams`), the parts' blocks run side by side only in
MLX's wide evaluation order (:mod:`~mlxq.engine.eval_order`): two 1,480-token prompts took
10.2-11.1 s a pair in blocks against 15.0-16.3 s in one call each, and 18.7-19.4 s in
blocks at MLX's default width.

The CPU's default (``MLXQ_PREFILL_BLOCK``: query rows a block, 0 turns it off); MLX's
GPU kernels skip the masked blocks themselves, so elsewhere a chunk attends in one call.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxq.engine.models.mlx_lm_seam import AttendingCache
from mlxq.engine.settings import whole_number
from mlxq.engine.slots.softmax import Softmax, causal_attention, mlx_softmax

BLOCK_ENV = "MLXQ_PREFILL_BLOCK"
# Measured on the real model against one call (one 1,480-token prompt, MLX's softmax): 128
# rows 1.6x, 256 1.5x, 512 1.4x. With the pow2 softmax, a pair of such prompts on two
# streams: 32 rows 1.16x 128's (a block's scores stay in the cache), 24 the same, 16 1.1x.
CPU_BLOCK = 32


def choose_block(backend: str) -> int:
    """Query rows a prefill block holds on ``backend`` (0: no blocks); raises ``ValueError``
    for a setting that is not a whole number, 0 or more."""
    default = CPU_BLOCK if backend == "cpu" else 0
    return whole_number(BLOCK_ENV, default, 0, " of query rows (0: off)")


class BlockedCache(KVCache, AttendingCache):
    """mlx-lm's ``KVCache`` whose causal attention runs in blocks of ``block`` query rows,
    each composed with ``softmax`` (:mod:`~mlxq.engine.slots.softmax`)."""

    def __init__(self, block: int, softmax: Softmax = mlx_softmax) -> None:
        super().__init__()
        self.block, self.softmax = block, softmax

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """The chunk's queries (the last of the cache's ``offset`` positions) over the keys
        up to each; a mask other than mlx-lm's ``"causal"`` attends in one call."""
        keys, values = self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        if not (isinstance(mask, str) and mask == "causal"):
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask
            )
        rows = queries.shape[2]
        start, outs = self.offset - rows, []
        for lo in range(0, rows, self.block):
            hi = min(rows, lo + self.block)
            end = start + hi  # (the block's last query sees the keys up to its own)
            k, v = keys[..., :end, :], values[..., :end, :]
            q = queries[:, :, lo:hi]
            # One block after another on a stream: laid out level by level (eval_order),
            # every block's scores would otherwise be alive at once.
            q = mx.depends(q, outs[-1]) if outs else q
            outs.append(causal_attention(q, k, v, scale, self.softmax))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def prompt_cache(model: nn.Module, block: int, softmax: Softmax = mlx_softmax) -> list[KVCache]:
    """A temporary prefill cache for ``model``: mlx-lm's, or with ``block`` one whose
    attention runs in blocks with ``softmax`` (the slot engine's models take a plain
    ``KVCache`` a layer)."""
    caches = make_prompt_cache(model)
    return [BlockedCache(block, softmax) for _ in caches] if block else caches
