"""Where a wide decode step's device time goes, and its floor (and the bound it sets on any batch).

For each ``--rows``, one decode step of the preset's shape is cut into its parts, each
timed alone on the device (random bf16 weights and cache; the median of ``--repeat``
evaluations after a warm-up):

- ``matmuls``: every layer's projections (q/k/v and gate/up fused, as the CUDA default
  runs them), no attention;
- ``lm head``: the ``[rows, hidden] @ [hidden, vocab]`` logits;
- ``attention``: the decode attention kernel (``--attention``: ``gqa``, mlxq's grouped
  one, or ``ragged``, its CUDA kernel) over ``--span`` positions, each row masked to a
  length drawn around ``--mean-length``, every layer;
- ``sampling``: greedy argmax and the logsumexp a logprob needs, over the logits;
- ``step``: the whole compiled decode step as the engine runs it, steps launched back
  to back without waiting (the engine's overlap), so its time is the larger of the
  host's launch and the device's work;
- ``launch``: the host's CPU time in those launches, per step: what MLX alone costs the
  host for one step, with no engine Python at all (the floor of an engine's host time).

Each part is launched ``--chain`` times in one evaluation so that the device, not the
host's launch, sets its time. ``floor`` adds the parts: the device time of a step with
no host cost at all. Also measured: a large matmul's TFLOP/s and a copy's bandwidth
(the device's own ceilings), and the step's ideal time at those rates (its FLOPs, or its
weights and the KV it reads at ``--mean-length`` per row, whichever takes longer).

The roofline bounds what any batch can gain over the first ``--rows``: a decoded token
costs at least its FLOPs at the device's rate however wide the batch (and its KV bytes
at the bandwidth), while a step of few rows costs at least one read of the weights. The
script prints that bound for decoding alone and for requests of ``--prompt-tokens`` in
and ``--output-tokens`` out (their prefill at its FLOPs, shared by both batch sizes):
no engine that runs the narrow batch at its roofline reaches a larger ratio.

Usage: ``python bench/step_floor.py --preset llama-3.2-1b --rows 256,512,1024 --span 384``
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from common import describe_device, fmt_num, median_seconds, set_up_like_mlxq, table


def ceilings(repeat: int) -> tuple[float, float]:
    """(bf16 matmul TFLOP/s, copy GB/s) measured on this device."""
    import mlx.core as mx

    n = 8192 if mx.default_device() == mx.gpu else 256
    a, b = (mx.random.normal((n, n)).astype(mx.bfloat16) for _ in range(2))
    big = mx.random.normal((4 * n * n,)).astype(mx.bfloat16)  # 512 MiB on a GPU
    mx.eval(a, b, big)
    mm = median_seconds(lambda: a @ b, repeat, 4)
    cp = median_seconds(lambda: big + 1, repeat, 4)  # reads and writes every byte once
    return 2 * n**3 / mm / 1e12, 2 * big.nbytes / cp / 1e9


def parts(
    cfg: dict[str, Any], rows: int, span: int, mean: int, kernel: str, repeat: int, chain: int
) -> dict[str, float]:
    """Milliseconds of each part of one step of ``rows`` rows (module docstring)."""
    import mlx.core as mx

    from mlxq.engine.slots.attention import KERNELS

    bf = mx.bfloat16
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    qh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // qh)
    rnd = lambda *shape: (mx.random.normal(shape) * 0.02).astype(bf)  # noqa: E731
    weights = [
        (rnd((qh + 2 * kvh) * hd, h), rnd(h, qh * hd), rnd(2 * inter, h), rnd(h, inter))
        for _ in range(layers)
    ]
    head = rnd(cfg["vocab_size"], h)
    x, xi, xq = rnd(rows, h), rnd(rows, inter), rnd(rows, qh * hd)
    q = rnd(rows, qh, 1, hd)
    kv = [(rnd(rows, kvh, span, hd), rnd(rows, kvh, span, hd)) for _ in range(layers)]
    lengths = mx.minimum(mx.random.randint(1, 2 * mean, (rows,)), span)
    mask = (mx.arange(span)[None] < lengths[:, None])[:, None, None, :]
    logits = rnd(rows, cfg["vocab_size"])
    mx.eval(weights, head, x, xi, xq, q, kv, mask, logits)

    def matmuls() -> list[Any]:
        return [(x @ a.T, xq @ o.T, x @ g.T, xi @ d.T) for a, o, g, d in weights]

    def attention() -> list[Any]:
        return [KERNELS[kernel](q, k, v, hd**-0.5, mask) for k, v in kv]

    def sampling() -> list[Any]:
        return [mx.argmax(logits, axis=-1), mx.logsumexp(logits.astype(mx.float32), axis=-1)]

    out = {
        "matmuls": median_seconds(matmuls, repeat, chain),
        "lm head": median_seconds(lambda: x @ head.T, repeat, chain),
        "attention": median_seconds(attention, repeat, chain),
        "sampling": median_seconds(sampling, repeat, chain),
    }
    return {k: v * 1e3 for k, v in out.items()}


def engine_step(
    model: Any, info: Any, rows: int, span: int, mean: int, kernel: str, steps: int
) -> tuple[float, float]:
    """Milliseconds per compiled decode step over ``rows`` rows of ~``mean`` tokens,
    ``steps`` launched back to back (each feeding the next, no host wait), and the host
    CPU milliseconds of each step's launch."""
    import mlx.core as mx

    from mlxq.engine.hardware import backend_name
    from mlxq.engine.models import fused_projections, mlx_lm_seam
    from mlxq.engine.models.fused_projections import fuse_projections
    from mlxq.engine.slots.attention import KERNELS
    from mlxq.engine.slots.cache import SlotCache
    from mlxq.engine.slots.compiled import CompiledForward

    mlx_lm_seam.install(model)
    fuse_projections(model, fused_projections.wanted(backend_name()))  # (as the engine runs)
    cache = SlotCache(len(model.layers), rows)
    shape = (rows, info.num_kv_heads, span, info.head_dim)
    dtype = getattr(mx, info.dtype)
    cache.keys = [mx.zeros(shape, dtype=dtype) for _ in model.layers]
    cache.values = [mx.zeros(shape, dtype=dtype) for _ in model.layers]
    cache.capacity = span
    mx.eval(cache.keys, cache.values)
    forward = CompiledForward(model, cache, KERNELS[kernel])
    tokens = mx.zeros((rows,), dtype=mx.uint32)
    positions = mx.minimum(mx.random.randint(0, 2 * mean, (rows,)), span - 1)

    def run(n: int) -> tuple[float, float]:
        nonlocal tokens
        tic, host = time.perf_counter(), 0.0
        for _ in range(n):
            cpu = time.thread_time()
            tokens = mx.argmax(forward(tokens, positions), axis=-1).astype(mx.uint32)
            mx.async_eval(tokens)
            host += time.thread_time() - cpu
        mx.eval(tokens)
        return (time.perf_counter() - tic) / n, host / n

    run(3)
    wall, host = run(steps)
    return wall * 1e3, host * 1e3


def main(argv: list[str] | None = None) -> int:
    set_up_like_mlxq()
    from mlxq.engine.models.facts import model_info
    from mlxq.engine.models.make import PRESETS, build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--rows", default="256,512,1024", help="comma-separated batch sizes")
    ap.add_argument("--span", type=int, default=384, help="cache positions attended per row")
    ap.add_argument("--mean-length", type=int, default=200, help="mean tokens a row holds")
    ap.add_argument("--attention", default="gqa", help="the decode attention kernel")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--chain", type=int, default=4, help="launches of a part per evaluation")
    ap.add_argument("--steps", type=int, default=40, help="engine steps timed back to back")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="a request's prompt (bound)")
    ap.add_argument("--output-tokens", type=int, default=87, help="its mean output (bound)")
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset]
    print(describe_device(), file=sys.stderr)
    tflops, gbs = ceilings(args.repeat)
    model, _ = build_model(args.preset)
    info = model_info(model, args.preset, vocab_size=cfg["vocab_size"])
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    cost = Roofline(model, cfg, info.kv_bytes_per_token, args.mean_length, tflops, gbs)
    head = ["rows", "matmuls", "lm head", "attention", "sampling", "floor", "step", "launch"]
    head.append("ideal")
    head.append("ideal us/token")
    out = []
    rows_arg = args.rows.split(",")
    for rows in map(int, rows_arg):
        p = parts(cfg, rows, args.span, args.mean_length, args.attention, args.repeat, args.chain)
        step, launch = engine_step(
            model, info, rows, args.span, args.mean_length, args.attention, args.steps
        )
        ideal = cost.step_ms(rows)
        out.append([f"{rows:,}", *(fmt_num(p[k], 2) for k in head[1:5]),
                    fmt_num(sum(p.values()), 2), fmt_num(step, 2), fmt_num(launch, 2),
                    fmt_num(ideal, 2),
                    fmt_num(ideal / rows * 1e3, 2)])  # fmt: skip
    print(
        f"{args.preset}: {layers} layers, hidden {h}, vocab {vocab:,}, bf16; span {args.span}, "
        f"{args.attention} attention; "
        f"ideal at {tflops:.0f} TFLOP/s and {gbs:,.0f} GB/s (KV {args.mean_length} a row)"
    )
    print("milliseconds per decode step:")
    print(table(head, out))
    print(
        "roofline bound: the most any batch's tok/s can be over each rows' at the device's "
        f"rates, decoding alone and end to end ({args.prompt_tokens} prompt + "
        f"{args.output_tokens} output tokens a request, prefill at its FLOPs):"
    )
    bounds = [cost.bound(int(r), args.prompt_tokens, args.output_tokens) for r in rows_arg]
    print(table(["rows", "us/token", "best us/token", "decode", "end to end"], bounds))
    return 0


class Roofline:
    """A model's ideal costs at the device's measured rates (module docstring)."""

    def __init__(
        self, model: Any, cfg: dict[str, Any], kv_token: int, mean: int, tflops: float, gbs: float
    ) -> None:
        h, vocab = cfg["hidden_size"], cfg["vocab_size"]
        qh, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        # Weights a token multiplies: all but an input embedding read by row (a tied
        # embedding is also the LM head, so it counts).
        total = sum(v.size for _, v in _leaves(model))
        matmul = total if cfg.get("tie_word_embeddings") else total - vocab * h
        attention = 4 * layers * qh * cfg.get("head_dim", h // qh) * mean  # q.k and p.v
        self.flops = 2 * matmul + attention  # per decoded token
        self.prefill_flops = 2 * (matmul - vocab * h) + attention  # per prompt token, no head
        self.weight_bytes = 2 * matmul  # bf16, read once a step
        self.kv_bytes = mean * kv_token  # read per row per step
        self.flop_s, self.byte_s = tflops * 1e12, gbs * 1e9

    def step_ms(self, rows: int) -> float:
        """A step's ideal: its FLOPs or its bytes at the device's rates, the larger."""
        flop = rows * self.flops / self.flop_s
        byte = (self.weight_bytes + rows * self.kv_bytes) / self.byte_s
        return max(flop, byte) * 1e3

    def bound(self, rows: int, prompt: int, output: int) -> list[str]:
        """The most any batch gains over ``rows`` at the roofline (decoding, end to end),
        as a row of the bound's table."""
        narrow = self.step_ms(rows) / rows / 1e3  # seconds a token
        best = max(self.flops / self.flop_s, self.kv_bytes / self.byte_s)
        prefill = prompt * self.prefill_flops / self.flop_s
        end = (prefill + output * narrow) / (prefill + output * best)
        us = [fmt_num(t * 1e6, 2) for t in (narrow, best)]
        return [f"{rows:,}", *us, f"{narrow / best:.2f}x", f"{end:.2f}x"]


def _leaves(model: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


if __name__ == "__main__":
    sys.exit(main())
