"""A prefill call split over CPU streams, so that both cores of a small CPU work on it.

On the CPU, MLX runs each stream's work on the stream's own thread, and most of a prefill
other than its matrix multiplies (the attention's softmax, norms, RoPE) runs on one
thread a stream. A group's prompts are therefore split into parts of about equal rows,
each part's forward built on its own stream and all of them evaluated at once, with
OpenBLAS's threads shared out among the streams (:func:`mlxq.engine.blas.shared_among`).
Each part's rows are computed exactly as alone: only which thread runs them changes.
Measured on a 2-core CPU: two 1,480-token prompts on two streams 1.57-1.69x one stream's
prompt tok/s (bench/RESULTS.md).

The split is the CPU's default (``MLXQ_PREFILL_STREAMS``: streams a call may use; 1 turns
it off); other backends run a call on one stream, where one kernel already fills the device.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import mlx.core as mx

from mlxq.engine import blas
from mlxq.engine.settings import whole_number

STREAMS_ENV = "MLXQ_PREFILL_STREAMS"
# (Two measured; more streams than cores only split the cores' time.)
CPU_STREAMS = 2


def choose_streams(backend: str, env: str = STREAMS_ENV) -> int:
    """Streams one prefill call (or with ``env`` another split, such as the decode
    attention's) may use on ``backend`` (module docstring); raises ``ValueError`` for a
    setting that is not a positive whole number, or more than 1 off the CPU."""
    default = min(CPU_STREAMS, os.cpu_count() or 1) if backend == "cpu" else 1
    count = whole_number(env, default, 1, " of streams")
    if count > 1 and backend != "cpu":
        raise ValueError(f"{env}={count}: the work splits over CPU streams only")
    return count


def cpu_streams(count: int) -> list[mx.Stream]:
    """``count`` CPU streams: the thread's default one, then new ones."""
    return [mx.default_stream(mx.cpu)] + [mx.new_stream(mx.cpu) for _ in range(count - 1)]


class PrefillStreams:
    """The CPU streams a prefill call splits over (the first: the thread's default)."""

    def __init__(self, count: int) -> None:
        self.streams = cpu_streams(count)

    def parts(self, rows: int) -> list[tuple[int, int]]:
        """Rows ``0..rows-1`` as contiguous parts of about equal size, one a stream at
        most, none empty."""
        count = min(len(self.streams), rows)
        bounds = [rows * i // count for i in range(count + 1)]
        return list(itertools.pairwise(bounds))

    def evaluate(self, arrays: Sequence[mx.array], parts: int) -> None:
        """Evaluate the parts' arrays at once, OpenBLAS's threads shared among them."""
        with blas.shared_among(parts):
            mx.eval(list(arrays))
