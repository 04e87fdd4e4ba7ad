"""Causal attention in blocks of query rows on two CPU streams: does it run side by side?

Reproduces, without a model, what ``mlxq/engine/slots/causal_blocks.py`` found: one
prompt's attention in blocks of 128 query rows takes about half the time of one causal
call, but two prompts on two CPU streams in blocks take about twice one prompt's time,
where one call each runs side by side. Random float32 q, k and v of ``--tokens``
positions (9 query and 3 KV heads of 64, SmolLM2-135M's), ``--layers`` attentions
chained, OpenBLAS's threads shared between the streams as the prefill does. Prints the
best of ``--repeat`` for each case; see bench/RESULTS.md. The cause is MLX's evaluation
order (:mod:`mlxq.engine.eval_order`): this script keeps MLX's default width, so run it
with ``MLX_BFS_MAX_WIDTH=4096`` to see the blocks run side by side, as the engine's do.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx

from mlxq.engine import blas

HEADS, KV_HEADS, DIM = 9, 3, 64
Attention = Callable[[mx.array, mx.array, mx.array], mx.array]


def one_call(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5, mask="causal")


def in_blocks(block: int) -> Attention:
    def attend(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        rows, outs = q.shape[2], []
        for lo in range(0, rows, block):
            hi = min(rows, lo + block)
            outs.append(one_call(q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi]))
        return mx.concatenate(outs, axis=2)

    return attend


def timed(attend: Attention, inputs: list[tuple[mx.array, ...]], layers: int, repeat: int) -> float:
    """Best seconds for each input's ``layers`` chained attentions, one stream each."""
    streams = [mx.default_stream(mx.cpu)] + [mx.new_stream(mx.cpu) for _ in inputs[1:]]
    best = float("inf")
    for _ in range(repeat):
        tic, outs = time.perf_counter(), []
        for (q, k, v), stream in zip(inputs, streams, strict=True):
            with mx.stream(stream):
                x = q
                for _ in range(layers):
                    x = attend(x, k, v)
                outs.append(x)
        with blas.shared_among(2):
            mx.eval(outs)
        best = min(best, time.perf_counter() - tic)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1480)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    mx.set_default_device(mx.cpu)
    inputs = []
    for _ in range(2):
        q = mx.random.normal((1, HEADS, args.tokens, DIM))
        k, v = (mx.random.normal((1, KV_HEADS, args.tokens, DIM)) for _ in range(2))
        mx.eval(q, k, v)
        inputs.append((q, k, v))
    cases = [("one call", one_call), (f"blocks of {args.block}", in_blocks(args.block))]
    for name, attend in cases:
        one = timed(attend, inputs[:1], args.layers, args.repeat)
        two = timed(attend, inputs, args.layers, args.repeat)
        print(f"{name}: one part {one:.2f} s, two on two streams {two:.2f} s ({two / one:.2f}x)")


if __name__ == "__main__":
    main()
