"""A decode step's sampling on its own, free and masked: host and device time by part.

A constrained step samples after its model's part, in a launch of its own, once the mask
helper has filled the step's masks; a free step's sampling rides in its model's launch.
This times that launch for ``--rows`` rows of ``--vocab``-wide logits already on the
device, built as the slot engine builds it (``slot_step.sample`` with a hook that
applies a table of ``--distinct`` masks through ``DeviceMasks``, as
``ConstraintBatch.process`` does when every row's mask is prepared):

- ``free``: the engine's sampling alone (logprobs, greedy argmax);
- ``upload``: the mask table to the device and each row's picked there;
- ``upload + apply``: and applied to the logits;
- ``masked``: the whole constrained sampling.

For each: host ms building the graph, host ms in ``mx.async_eval`` (the launch) and ms
waiting for the result; medians of ``--repeat`` after ``--warmup``. The table is a fresh
numpy array each time, as the helper hands over.

Usage: ``python bench/sampling_launch.py --rows 256 --vocab 128256`` (see bench/README.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from common import describe_device, set_up_like_mlxq, table

PARTS = ("free", "upload", "upload + apply", "masked")


class _TableHook:
    """A batch logits hook applying one table of masks, a row picked per logits row."""

    def __init__(self, table: Any, index: list[int]) -> None:
        self.table, self.index = table, index

    def process(self, logits: Any, keys: list[str]) -> Any:
        from mlxq.engine.constraints.device_masks import DeviceMasks

        return DeviceMasks(self.table.copy(), self.index).apply(logits)


def builders(rows: int, vocab: int, distinct: int) -> dict[str, Callable[[Any], Any]]:
    """Per part, a function from the logits to what that part launches."""
    import numpy as np
    from mlx_lm.sample_utils import make_sampler

    from mlxq.engine.constraints.device_masks import DeviceMasks
    from mlxq.engine.slots.step import Row, sample

    rng = np.random.default_rng(0)
    words = (vocab + 31) // 32
    masks = rng.integers(-(2**31), 2**31, size=(distinct, words), dtype=np.int64)
    masks = masks.astype(np.int32)
    index = [i % distinct for i in range(rows)]
    greedy = make_sampler(temp=0.0)
    # (sample() reads its key, and whether it keeps logprobs)
    run: Any = SimpleNamespace(job=SimpleNamespace(key="k"), logprobs=None)
    batch = [Row(run, slot, greedy, [], 0) for slot in range(rows)]
    hook = _TableHook(masks, index)
    return {
        "free": lambda logits: sample(batch, logits, [])[0],
        "upload": lambda logits: DeviceMasks(masks.copy(), index).words,
        "upload + apply": lambda logits: hook.process(logits, []),
        "masked": lambda logits: sample(batch, logits, [hook])[0],
    }


def time_part(build: Callable[[Any], Any], logits: Any, warmup: int, repeat: int) -> dict:
    """Median host ms building and launching ``build(logits)``, and ms waiting for it."""
    import mlx.core as mx

    spans: list[tuple[float, float, float]] = []
    for i in range(warmup + repeat):
        start = time.perf_counter()
        out = build(logits)
        built = time.perf_counter()
        mx.async_eval(out)
        launched = time.perf_counter()
        mx.eval(out)
        done = time.perf_counter()
        del out  # (freed here, not inside the next build's timing)
        if i >= warmup:
            spans.append((built - start, launched - built, done - launched))
    keys = ("build_ms", "launch_ms", "wait_ms")
    return {k: 1000 * statistics.median(s[i] for s in spans) for i, k in enumerate(keys)}


def main(argv: list[str] | None = None) -> int:
    set_up_like_mlxq()
    args = parse_args(argv)
    import mlx.core as mx

    logits = mx.random.normal((args.rows, args.vocab)).astype(mx.bfloat16)
    mx.eval(logits)
    parts = builders(args.rows, args.vocab, args.distinct)
    figures = {p: time_part(parts[p], logits, args.warmup, args.repeat) for p in PARTS}
    print(
        f"{describe_device()} | {args.rows} rows x {args.vocab} logits (bf16), "
        f"{args.distinct} distinct masks | medians of {args.repeat}"
    )
    cells = []
    for part, f in figures.items():
        total = f["build_ms"] + f["launch_ms"] + f["wait_ms"]
        cells.append([part, *(f"{f[k]:.3f}" for k in f), f"{total:.3f}"])
    print(table(["sampling", "build ms", "launch ms", "wait ms", "total ms"], cells))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128256, help="logits per row")
    p.add_argument("--distinct", type=int, default=13, help="distinct masks in the table")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=50)
    args = p.parse_args(argv)
    if min(args.rows, args.vocab, args.distinct, args.repeat) < 1 or args.warmup < 0:
        p.error("--rows, --vocab, --distinct and --repeat must be at least 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
