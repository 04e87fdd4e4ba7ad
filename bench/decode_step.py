"""One decode step at a full batch: the attention paths side by side.

For each cache length, the same model runs one decode step of ``--rows`` rows (one new
token each, every row at that length) through:

- ``kvcache (no mask)``: mlx-lm's plain ``KVCache``; one length for all rows, so MLX's
  fused attention runs without a mask: the fused kernel's ceiling, not a batched engine;
- ``BatchKVCache (masked SDPA)``: mlx-lm's batch cache, whose per-row mask (an array)
  takes MLX's ``scaled_dot_product_attention`` off its fused path on CUDA;
- ``slot + gqa``: mlxq's slot cache with its own grouped-query attention (and the same
  through ``mx.compile``);
- ``slot + fused``: mlxq's slot cache with MLX's fused attention and a bool length mask.

Each figure is the median over ``--repeat`` timed steps (after ``--warmup``), the cache
reset to the same length before each. Random weights and random cache contents.

Usage: ``python bench/decode_step.py --preset llama-3.2-1b --rows 256 --lengths 300,1000``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from common import describe_device, fmt_num, fmt_ratio, median_seconds, set_up_like_mlxq, table

PATHS = ("kvcache", "batch", "slot-gqa", "slot-gqa-compiled", "slot-fused")
LABELS = {
    "kvcache": "kvcache (no mask)",
    "batch": "BatchKVCache (masked SDPA)",
    "slot-gqa": "slot + gqa",
    "slot-gqa-compiled": "slot + gqa, mx.compile",
    "slot-fused": "slot + fused",
}


def _kv(shape: tuple[int, ...], dtype: Any) -> Any:
    import mlx.core as mx

    return (mx.random.normal(shape) * 0.5).astype(dtype)


def make_step(path: str, model: Any, info: Any, rows: int, length: int) -> Callable[[], Any]:
    """A function running one decode step of ``path`` at ``length``; returns the logits."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from mlxq.engine.models import mlx_lm_seam
    from mlxq.engine.slots.attention import KERNELS
    from mlxq.engine.slots.cache import DecodeState, SlotCache, SlotLayer

    dtype = getattr(mx, info.dtype)
    cap = (length // 256 + 1) * 256
    shape = (rows, info.num_kv_heads, cap, info.head_dim)
    tokens = mx.array([[7]] * rows)
    layers = range(info.num_layers)
    if path == "kvcache":
        caches = [KVCache() for _ in layers]
        for c in caches:
            c.keys, c.values = _kv(shape, dtype), _kv(shape, dtype)
        mx.eval([(c.keys, c.values) for c in caches])

        def step() -> Any:
            for c in caches:
                c.offset = length
            return model(tokens, cache=caches)

        return step
    if path == "batch":
        caches = [BatchKVCache([0] * rows) for _ in layers]
        for c in caches:
            c.keys, c.values = _kv(shape, dtype), _kv(shape, dtype)
        mx.eval([(c.keys, c.values) for c in caches])

        def step() -> Any:
            for c in caches:
                c._idx, c.offset = length, mx.full((rows,), length)
            return model(tokens, cache=caches)

        return step
    mlx_lm_seam.install(model)
    cache = SlotCache(info.num_layers, rows)
    cache.keys = [_kv(shape, dtype) for _ in layers]
    cache.values = [_kv(shape, dtype) for _ in layers]
    cache.capacity = cap
    mx.eval(cache.keys, cache.values)
    kernel = KERNELS[path.removeprefix("slot-")]

    def step() -> Any:
        state = DecodeState.make([length] * rows, rows, kernel)
        return model(tokens, cache=[SlotLayer(cache, i, state) for i in layers])

    return step


def main(argv: list[str] | None = None) -> int:
    set_up_like_mlxq()
    from mlxq.engine.models.make import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--lengths", default="300,1000", help="comma-separated cache lengths")
    ap.add_argument("--paths", default=",".join(PATHS), help="subset of " + ",".join(PATHS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    if bad := sorted(set(paths) - set(PATHS)):
        ap.error(f"--paths: unknown {', '.join(bad)}")

    import mlx.core as mx

    from mlxq.engine.models.facts import model_info
    from mlxq.engine.models.make import build_model

    model, _ = build_model(args.preset)
    info = model_info(model, args.preset)
    print(
        f"{args.preset} ({info.num_layers} layers, {info.num_kv_heads} KV heads x "
        f"{info.head_dim}, {info.dtype}) on {describe_device()}, {args.rows} rows, "
        f"median of {args.repeat} steps"
    )
    for length in (int(x) for x in args.lengths.split(",")):
        seconds = {}
        for path in paths:
            step = make_step(path, model, info, args.rows, length)
            seconds[path] = median_seconds(step, args.repeat, warmup=args.warmup)
            mx.clear_cache()
        base = seconds.get("batch")
        rows = [
            [
                LABELS[p],
                fmt_num(1000 * s, 2),
                fmt_num(args.rows / s, 0),
                fmt_ratio(base, s) if base else "-",
            ]
            for p, s in seconds.items()
        ]
        print(f"\nlength {length}")
        print(table(["path", "ms/step", "tok/s", "speed vs masked SDPA"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
