"""Prefill shape buckets alone: plain Python."""

from __future__ import annotations

from mlxq.engine.slots.buckets import bucket_rows, bucket_tokens, group_rows


def test_rows_round_to_powers_of_two_then_multiples_of_32() -> None:
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 17, 32, 33, 100, 256)] == [
        1, 2, 4, 8, 32, 32, 64, 128, 256,
    ]  # fmt: skip
    assert all(n <= bucket_rows(n) < 2 * n or n == 1 for n in range(1, 300))


def test_tokens_pad_the_last_chunk_only() -> None:
    assert bucket_tokens(0, 2048) == 0
    assert [bucket_tokens(n, 2048) for n in (1, 16, 17, 100, 256, 257, 1000)] == [
        16, 16, 32, 128, 256, 512, 1024,
    ]  # fmt: skip
    assert bucket_tokens(2048 + 5, 2048) == 2048 + 16  # whole chunks stay whole
    assert bucket_tokens(20, 7) == 21  # a chunk never grows past the chunk length
    # Few distinct shapes: every length up to 4,096 lands on one of 24 (12 per chunk).
    assert len({bucket_tokens(n, 2048) for n in range(1, 4097)}) == 24


def test_groups_above_32_rows_take_whole_buckets() -> None:
    assert [group_rows(n) for n in (1, 5, 31, 32, 33, 37, 63, 64, 100)] == [
        1, 5, 31, 32, 32, 32, 32, 64, 96,
    ]  # fmt: skip
    assert all(bucket_rows(group_rows(n)) == group_rows(n) for n in range(33, 300))
