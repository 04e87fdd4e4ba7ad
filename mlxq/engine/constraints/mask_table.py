"""A step's token bitmasks as a table of distinct rows and, per row, its entry.

Rows under one schema share most of their masks (every row at the same point of the
grammar has the same allowed tokens: 13 distinct masks for 64 JSON rows, on the bench's
schema), and on CUDA a mask's first device read of fresh host memory is the dear part
(3.0 ms of device time for 256 rows of a 128k vocabulary against 0.46 ms for masks
already there, H200): only the distinct rows go up, the device picks each row's.

Plain numpy (no MLX): it runs on the constraints' helper thread.
"""

from __future__ import annotations

import numpy as np

# Odd multipliers, one per 64-bit word: a row's fingerprint is a weighted sum (mod 2^64),
# so the same words in other places give another sum.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def distinct_rows(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of ``masks`` (rows, int32 words) and each row's index among them.

    Exact: rows are grouped by a fingerprint, then each is compared whole with the first
    row of its group; one that differs keeps an entry of its own.
    """
    n = len(masks)
    if n < 2:
        return masks.copy(), np.zeros(n, dtype=np.intp)  # (never the caller's buffer)
    words = _as_u64(masks)
    weights = (np.arange(words.shape[1], dtype=np.uint64) * _GOLDEN) | np.uint64(1)
    fingerprints = words @ weights  # wraps around: a hash, not a count (no temporary)
    _, first, index = np.unique(fingerprints, return_index=True, return_inverse=True)
    index = index.reshape(n).astype(np.intp)
    same = (words == words[first[index]]).all(axis=1)
    entries = first
    if not same.all():  # a fingerprint shared by different rows: never merge them
        collided = np.flatnonzero(~same)
        index[collided] = len(first) + np.arange(len(collided))
        entries = np.concatenate([first, collided])
    return masks[entries], index  # (a copy: the caller may reuse ``masks``)


def _as_u64(masks: np.ndarray) -> np.ndarray:
    """The rows as unsigned 64-bit words (an odd width gets a zero word: a copy)."""
    if masks.shape[1] % 2:
        masks = np.concatenate([masks, np.zeros((len(masks), 1), dtype=masks.dtype)], axis=1)
    return np.ascontiguousarray(masks).view(np.uint64)
