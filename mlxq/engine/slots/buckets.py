"""Prefill call shapes rounded to a few buckets, so a GPU builds each shape's kernels once.

On CUDA a prefill call of a new shape (rows x tokens) first builds its attention plan and
kernels: tens of milliseconds, more than the call itself for a small group. Rows finishing
one by one (as EOS makes them) join in groups of every size and length, so without
rounding almost every call is a new shape. Rounded, a worker meets a few dozen shapes
and then reuses them; the padding costs compute, which a host-bound GPU has to spare.

Plain Python (no MLX): :mod:`mlxq.engine.slots.prefill` pads to these sizes.
"""

from __future__ import annotations

MIN_TOKENS = 16  # shorter chunks cost the same on a GPU
ROW_STEP = 32  # above this many rows, round to multiples of it (padding under 1/2 anyway)
TOKEN_STEP = 256  # above this many tokens, likewise


def _round(n: int, floor: int, step: int) -> int:
    """``n`` up to a power of two (at least ``floor``) up to ``step``, then to a multiple
    of ``step``: at most 2x padding below ``step``, under ``step`` above it."""
    if n <= step:
        size = floor
        while size < n:
            size *= 2
        return min(size, step)
    return -(-n // step) * step


def bucket_rows(n: int) -> int:
    """The rows of a prefill call for ``n`` joining jobs (the rest are dummy rows)."""
    return _round(n, 1, ROW_STEP)


def group_rows(n: int) -> int:
    """How many of ``n`` waiting jobs to prefill together when calls are bucketed: above
    ``ROW_STEP`` a whole multiple of it, so the call has no dummy rows (the rest join with
    a later group). On a large model a prefill call is compute-bound: an 8B shape's varied
    outputs took 13.6 s to prefill in groups of ~37 padded to 64 rows, against 6.6 s for
    the same prompts in groups of 128. Below ``ROW_STEP`` every job goes (a call that
    small costs its fixed part, not its rows)."""
    return n if n <= ROW_STEP else n // ROW_STEP * ROW_STEP


def bucket_tokens(n: int, chunk: int) -> int:
    """The padded length of ``n`` prompt tokens run in chunks of ``chunk``: whole chunks,
    then the last one rounded (every chunk is then one of few lengths)."""
    if n <= 0:
        return 0
    full, rest = divmod(n, chunk)
    return full * chunk + (min(_round(rest, MIN_TOKENS, TOKEN_STEP), chunk) if rest else 0)
