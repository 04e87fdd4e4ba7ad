"""The distinct rows of a step's masks: exact, whatever the fingerprints do."""

from __future__ import annotations

import numpy as np
import pytest

from mlxq.engine.constraints import mask_table
from mlxq.engine.constraints.mask_table import distinct_rows


@pytest.mark.parametrize("width", [1, 7, 16, 4008])
def test_every_row_gets_back_its_own_mask(width: int) -> None:
    rng = np.random.default_rng(width)
    kinds = rng.integers(-(2**31), 2**31 - 1, size=(5, width), dtype=np.int64).astype(np.int32)
    masks = kinds[rng.integers(0, 5, 64)]
    table, index = distinct_rows(masks)
    assert np.array_equal(table[index], masks)
    assert len(table) == len(np.unique(masks, axis=0)) <= 5


def test_rows_whose_fingerprints_collide_stay_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    # Weights of 1: a fingerprint is the plain sum of a row's words, so swapped words collide.
    monkeypatch.setattr(mask_table, "_GOLDEN", np.uint64(0))
    masks = np.array([[1, 0, 2, 0], [2, 0, 1, 0], [1, 0, 2, 0], [3, 0, 3, 0]], dtype=np.int32)
    table, index = distinct_rows(masks)
    assert np.array_equal(table[index], masks)
    assert len(table) == 3 and index[0] == index[2] != index[1]


def test_one_row_or_none() -> None:
    one = np.full((1, 3), -1, dtype=np.int32)
    table, index = distinct_rows(one)
    assert np.array_equal(table, one) and index.tolist() == [0]
    assert distinct_rows(np.zeros((0, 3), dtype=np.int32))[1].tolist() == []


def test_the_table_is_never_the_callers_buffer() -> None:
    # (the constraints' helper fills its masks into one buffer, step after step)
    for rows in (1, 4):
        masks = np.arange(rows * 3, dtype=np.int32).reshape(rows, 3)
        table = distinct_rows(masks)[0]
        masks[:] = -7
        assert not np.shares_memory(table, masks) and (table != -7).all()
