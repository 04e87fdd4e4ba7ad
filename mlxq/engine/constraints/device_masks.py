"""Token bitmasks applied to logits on the device: the tokens a row's mask forbids go to -inf.

A mask row is the packed words llguidance fills (bit ``t % 32`` of word ``t // 32`` allows
token ``t``). On Metal, llguidance's kernel reads the words. Elsewhere, plain MLX ops: when
the logits are a whole number of words wide (most vocabularies are: 128256, 151936, 32000),
each logit is tested against its own row's word, the logits viewed as ``[rows, words, 32]``,
so a row's mask is never unpacked into a vocabulary of booleans; on CUDA that test and the
``where`` are one compiled kernel (a constrained step's sampling is a launch of its own, and
its host time is on the step's critical path). Other widths unpack the words first.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlxq.engine.hardware import backend_name


def _masked_words(words: mx.array, shifts: mx.array, logits: mx.array) -> mx.array:
    """``logits`` ``[rows, words, 32]`` where each row's word ``[rows, words, 1]`` has the
    bit, else -inf."""
    return mx.where(((words >> shifts) & 1).astype(mx.bool_), logits, -mx.inf)


# Shapeless: one trace serves every batch and vocabulary (elementwise ops only).
_fused_masked_words = mx.compile(_masked_words, shapeless=True)


class DeviceMasks:
    """Bitmasks (rows, words) on the device, ready to apply to logits; with ``index``,
    ``masks`` is a table of distinct rows and row ``i`` is its ``index[i]`` (gathered on
    the device: only the distinct rows are uploaded)."""

    def __init__(self, masks: np.ndarray, index: Sequence[int] | None = None) -> None:
        table = mx.array(masks)
        self.words = table if index is None else table[mx.array(index)]

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` (rows, vocab) with the forbidden tokens at -inf (:func:`apply_masks`)."""
        return apply_masks(logits, self.words)


@functools.cache
def _on_cuda() -> bool:
    return backend_name() == "cuda"


def _use_kernel() -> bool:
    """llguidance's MLX kernel is a Metal kernel; CUDA and the CPU use plain ops."""
    return mx.metal.is_available()


def apply_masks(logits: mx.array, masks: mx.array) -> mx.array:
    """``logits`` (rows, vocab) with the tokens each row's bitmask (rows, words) forbids set
    to -inf; bits past the mask's width forbid."""
    if _use_kernel():
        from llguidance.mlx import apply_token_bitmask_kernel

        return apply_token_bitmask_kernel(logits, masks)
    rows, words = masks.shape
    if logits.shape[-1] != words * 32:
        return mx.where(unpack_masks(masks, logits.shape[-1]), logits, -mx.inf)
    masked = _fused_masked_words if _on_cuda() else _masked_words
    shifts = mx.arange(32, dtype=mx.int32)  # (made here: MLX streams belong to their thread)
    out = masked(masks[:, :, None], shifts, logits.reshape(rows, words, 32))
    return out.reshape(rows, words * 32)


def unpack_masks(masks: mx.array, vocab: int) -> mx.array:
    """Bitmasks (rows, words) as booleans (rows, ``vocab``), with plain MLX ops."""
    rows, words = masks.shape
    shifts = mx.arange(32, dtype=mx.int32)
    bits = ((masks[:, :, None] >> shifts) & 1).reshape(rows, words * 32).astype(mx.bool_)
    if words * 32 >= vocab:
        return bits[:, :vocab]
    return mx.concatenate([bits, mx.zeros((rows, vocab - words * 32), dtype=mx.bool_)], axis=1)
