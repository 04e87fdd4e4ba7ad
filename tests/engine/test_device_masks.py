"""Token bitmasks applied to logits on the device (plain MLX ops, CUDA's compiled kernel,
a table of distinct masks picked per row): the allowed tokens keep their logits, the
rest go to -inf."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxq.engine.constraints import device_masks
from mlxq.engine.constraints.device_masks import DeviceMasks, apply_masks, unpack_masks


def test_masks_unpack_to_the_allowed_tokens():
    rng = np.random.default_rng(0)
    masks = rng.integers(-(2**31), 2**31, size=(3, 5), dtype=np.int64).astype(np.int32)
    expected = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little").astype(bool)
    for vocab in (150, 160, 170):  # narrower, exactly as wide, wider than the masks
        want = np.zeros((3, vocab), dtype=bool)
        want[:, : min(vocab, 160)] = expected[:, :vocab]
        assert (np.array(unpack_masks(mx.array(masks), vocab)) == want).all()
        logits = mx.array(rng.normal(size=(3, vocab)).astype(np.float32))
        out = np.array(apply_masks(logits, mx.array(masks)))
        assert (np.isneginf(out) == ~want).all()
        assert (out[want] == np.array(logits)[want]).all()


@pytest.mark.parametrize("vocab", [160, 150])  # whole words (no unpacking), and not
def test_a_table_of_distinct_masks_picked_per_row_masks_as_the_rows_themselves(vocab):
    rng = np.random.default_rng(2)
    table = rng.integers(-(2**31), 2**31, size=(3, 5), dtype=np.int64).astype(np.int32)
    index = [2, 0, 2, 1, 0]
    logits = mx.array(rng.normal(size=(5, vocab)).astype(np.float32)).astype(mx.bfloat16)
    picked = DeviceMasks(table, index).apply(logits)
    assert mx.array_equal(picked, DeviceMasks(table[index]).apply(logits)).item()
    assert mx.array_equal(picked, apply_masks(logits, mx.array(table[index]))).item()


def test_the_compiled_mask_kernel_equals_the_plain_ops():
    """CUDA's one fused kernel (shapeless: any rows, any words) computes what the plain ops
    do on the CPU, for every shape it meets without a new trace."""
    rng = np.random.default_rng(3)
    shifts = mx.arange(32, dtype=mx.int32)
    for rows, words in ((3, 5), (8, 2), (1, 7)):
        masks = rng.integers(-(2**31), 2**31, size=(rows, words, 1), dtype=np.int64)
        words3 = mx.array(masks.astype(np.int32))
        logits = mx.array(rng.normal(size=(rows, words, 32)).astype(np.float32))
        fused = device_masks._fused_masked_words(words3, shifts, logits)
        plain = device_masks._masked_words(words3, shifts, logits)
        assert mx.array_equal(fused, plain).item()
        allowed = np.unpackbits(masks.astype(np.int32).view(np.uint8), axis=2, bitorder="little")
        assert (np.isneginf(np.array(fused)) == (allowed == 0)).all()
