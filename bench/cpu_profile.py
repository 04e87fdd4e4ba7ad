"""Where mlxq's CPU time goes on a real model: a decode step and a prefill, part by part.

On a CPU (MLX's CPU backend, matmuls through OpenBLAS), for the GGUF loaded as ``mlxq
worker --model x.gguf`` loads it (weights as ``--dequantize`` says; ``auto`` is float32 on
this backend):

- **decode**, per ``--rows``: the slot engine's own step (``rows`` jobs of ``--context``
  prompt tokens, EOS off), timed over ``--steps`` steps, its host (Python) time measured
  as the engine thread's CPU time (MLX computes on its own stream thread), then the
  step's parts timed alone with the model's own weights at the step's shapes (lower
  quartiles of :func:`common.median_seconds` throughout: others' work on a shared machine
  only ever slows a run down): the 7 projections of every layer (float32, and
  ``--quantized``: MLX's quantized matmul on one layer, times the layers), the LM head,
  the decode attention (``gqa``) over the rows' positions, greedy sampling (the argmax;
  the logsumexp that rows asking for logprobs add, apart), the elementwise ops (norms,
  RoPE, SiLU, residuals), and what is left: cache writes, masks, reshapes and MLX's cost
  per op, shown by the op count of one forward's graph and the measured time of one
  small op;
- **prefill**: one ``--prompt``-token prompt through the model at each ``--chunks`` size
  (the engine's ``prefill_step``), its tok/s, and at the whole prompt its projections and
  attention alone (with the attention's scores times MLX's cost of one ``exp``);
- **the bound**: this CPU's float32 GEMM rate at these shapes, its copy bandwidth and
  MLX's ``exp`` per element, each part of a step per generated token, next to
  llama.cpp's whole token (``--llama-gen``, ``--llama-total``: tok/s measured by
  ``llama_server.py``).

``--cprofile N`` prints the N functions of the engine step with the most own time.

    python bench/cpu_profile.py --rows 16,64,128 --context 200 --prompt 1480
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

from common import describe_device, fmt_num, git_commit, median_seconds, quiet_logs, table

DECODE_COLUMNS = ("rows,step,host,proj f32,proj quant,lm head,attention,sampling,elementwise,"
                  "rest,us/op,GEMM GFLOP/s,tok/s,GEMM ms/tok,+logprobs").split(",")  # fmt: skip
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- the model's shapes ---------------------------------------------------------------------
def projections(model: Any) -> list[list[Any]]:
    """Per layer, its 7 projection modules (mlx-lm's llama layout)."""
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out.append([getattr(attn, n) if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                    else getattr(mlp, n) for n in PROJECTIONS])  # fmt: skip
    return out


def in_out(module: Any) -> tuple[int, int]:
    """``(inputs, outputs)`` of a linear module, quantized or not."""
    w = module.weight
    cols = w.shape[1] * 32 // module.bits if hasattr(module, "bits") else w.shape[1]
    return cols, w.shape[0]


def flops_per_token(model: Any) -> tuple[int, int]:
    """``(projections, lm head)`` FLOPs a token costs (2 per weight)."""
    proj = sum(2 * i * o for layer in projections(model) for i, o in map(in_out, layer))
    head = 2 * model.args.hidden_size * model.args.vocab_size
    return proj, head


# -- parts timed alone ------------------------------------------------------------------------
def time_projections(layers: list[list[Any]], rows: int, repeat: int) -> float:
    """Seconds of every given layer's 7 projections on ``rows`` tokens."""
    import mlx.core as mx

    inputs = {}
    for layer in layers:
        for m in layer:
            i = in_out(m)[0]
            if i not in inputs:
                inputs[i] = mx.random.normal((rows, i)).astype(mx.float32) * 0.1
    mx.eval(list(inputs.values()))

    def build() -> list[Any]:
        return [m(inputs[in_out(m)[0]]) for layer in layers for m in layer]

    return median_seconds(build, repeat, quartile=True)


def time_head(model: Any, rows: int, repeat: int) -> float:
    import mlx.core as mx

    x = mx.random.normal((rows, 1, model.args.hidden_size)) * 0.1
    mx.eval(x)
    head = model.model.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head
    return median_seconds(lambda: head(x), repeat, quartile=True)


def time_attention(model: Any, rows: int, context: int, repeat: int) -> float:
    """Seconds of the decode attention (``gqa``) of every layer, rows holding
    ``context`` positions on average (a cache of twice that)."""
    import mlx.core as mx

    from mlxq.engine.slots.attention import KERNELS

    a = model.args
    heads, kv, dim = (
        a.num_attention_heads,
        a.num_key_value_heads,
        a.hidden_size // a.num_attention_heads,
    )
    dim = getattr(a, "head_dim", None) or dim
    span = 2 * context
    q = mx.random.normal((rows, heads, 1, dim))
    caches = [(mx.random.normal((rows, kv, span, dim)), mx.random.normal((rows, kv, span, dim)))
              for _ in range(a.num_hidden_layers)]  # fmt: skip
    lengths = mx.random.randint(1, span, (rows,))
    mask = (mx.arange(span)[None] < lengths[:, None])[:, None, None, :]
    mx.eval(q, caches, mask)
    kernel = KERNELS["gqa"]
    return median_seconds(
        lambda: [kernel(q, k, v, dim**-0.5, mask) for k, v in caches], repeat, quartile=True
    )


def time_sampling(vocab: int, rows: int, repeat: int) -> float:
    """Greedy sampling as a step runs it when no row asks for logprobs: the logits'
    argmax (with ``logprobs``, the logsumexp too: :func:`time_logprobs`)."""
    import mlx.core as mx

    logits = mx.random.normal((rows, vocab))
    mx.eval(logits)
    return median_seconds(lambda: mx.argmax(logits, axis=-1), repeat, quartile=True)


def time_logprobs(vocab: int, rows: int, repeat: int) -> float:
    """What rows asking for logprobs add to sampling: the logsumexp over the vocabulary
    (an ``exp`` an entry; the engine skips it where no row asks)."""
    import mlx.core as mx

    logits = mx.random.normal((rows, vocab))
    mx.eval(logits)
    return median_seconds(
        lambda: logits - mx.logsumexp(logits, axis=-1, keepdims=True), repeat, quartile=True
    )


def time_elementwise(model: Any, rows: int, repeat: int) -> float:
    """Seconds of every layer's elementwise work on ``rows`` tokens: two RMS norms, RoPE
    on the query and key, SiLU(gate) x up (the engine's, ``MLXQ_SILU``), two residual adds
    (the final norm left out)."""
    import mlx.core as mx

    from mlxq.engine.hardware import backend_name
    from mlxq.engine.slots.silu import SWIGLUS, choose_silu

    a = model.args
    heads, kv = a.num_attention_heads, a.num_key_value_heads
    dim = getattr(a, "head_dim", None) or a.hidden_size // heads
    h = mx.random.normal((rows, 1, a.hidden_size))
    g, u = (mx.random.normal((rows, 1, a.intermediate_size)) for _ in range(2))
    q, k = mx.random.normal((rows, heads, 1, dim)), mx.random.normal((rows, kv, 1, dim))
    w = mx.ones((a.hidden_size,))
    offsets = mx.random.randint(0, 256, (rows,))
    mx.eval(h, g, u, q, k, w, offsets)
    rope = model.model.layers[0].self_attn.rope
    swiglu = SWIGLUS[choose_silu(backend_name())]

    def build() -> list[Any]:
        out = []
        for _ in range(a.num_hidden_layers):
            out += [mx.fast.rms_norm(h, w, 1e-5), mx.fast.rms_norm(h, w, 1e-5), h + h, h + h]
            out += [rope(q, offset=offsets), rope(k, offset=offsets), swiglu(g, u)]
        return out

    return median_seconds(build, repeat, quartile=True)


def op_cost(rows: int, hidden: int, repeat: int, chain: int = 200) -> float:
    """Seconds of one small elementwise op on ``[rows, hidden]`` float32 in a chain."""
    import mlx.core as mx

    x = mx.random.normal((rows, hidden))
    mx.eval(x)

    def build() -> Any:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    return median_seconds(build, repeat, quartile=True) / chain


def forward_ops(model: Any, rows: int, context: int) -> int:
    """Nodes in the graph of one decode forward of ``rows`` rows (mlx-lm's own cache and
    attention: the engine's differs a little in attention), counted in its DOT export."""
    import tempfile

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    a = model.args
    kv, dim = (
        a.num_key_value_heads,
        getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads,
    )
    cache = make_prompt_cache(model)
    for c in cache:
        k = mx.zeros((rows, kv, context, dim))
        c.update_and_fetch(k, k)
    logits = model(mx.zeros((rows, 1), dtype=mx.int32), cache=cache)
    with tempfile.NamedTemporaryFile("w", suffix=".dot") as f:
        mx.export_to_dot(f.name, logits)
        text = Path(f.name).read_text()
    # Operations are the boxes; arrays are the ellipses (the default shape).
    return sum(1 for line in text.splitlines() if "shape=rectangle" in line or "shape=box" in line)


# -- the engine's own step --------------------------------------------------------------------
def engine_steps(
    model: Any, tokenizer: Any, rows: int, context: int, steps: int, top: int
) -> dict[str, Any]:
    """The slot engine's decode step over ``rows`` jobs of ``context`` prompt tokens:
    wall ms a step, host ms a step (the engine thread's CPU time), and with ``top`` the
    cProfile table of its own time."""
    import mlx.core as mx

    from mlxq.engine.factory import make_engine
    from mlxq.engine.sampling import EngineJob
    from mlxq.wire import Request

    engine = make_engine(model, tokenizer, "profile", max_batch=rows)
    engine.warmup()
    key = mx.random.key(0)
    ids = mx.random.randint(100, 40_000, (rows, context), key=key).tolist()
    for i, prompt in enumerate(ids):
        engine.add(EngineJob(f"r{i}", Request(prompt=prompt, max_tokens=10 * steps + 64)))
    # Every row joined and decoding: prefill goes in groups between decode steps, and a
    # timed step that prefilled a group would count its prefill.
    while len(engine.batch.rows) < rows or engine.stats().decode_steps < 4:
        engine.step()
    prefills = engine.stats().prefill_calls
    walls, hosts = [], []
    for _ in range(steps):
        wall, host = time.perf_counter(), time.thread_time()
        engine.step()
        walls.append(time.perf_counter() - wall)
        hosts.append(time.thread_time() - host)
    assert engine.stats().prefill_calls == prefills, "a timed step prefilled"
    # The fastest steps: a shared machine's other work only ever slows a step down.
    walls, hosts = sorted(walls), sorted(hosts)
    out: dict[str, Any] = {"step": walls[len(walls) // 4], "host": hosts[len(hosts) // 4]}
    out["median_step"] = walls[len(walls) // 2]
    if top:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            engine.step()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        out["profile"] = buf.getvalue()
    return out


# -- prefill ----------------------------------------------------------------------------------
def prefill_seconds(model: Any, prompt: int, chunk: int, repeat: int) -> float:
    """Seconds to prefill one ``prompt``-token prompt in chunks of ``chunk`` tokens, as the
    engine's prefill runs them (the cache evaluated after each chunk, logits never)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.random.randint(100, 40_000, (1, prompt))
    times = []
    for _ in range(repeat + 1):
        cache = make_prompt_cache(model)
        tic = time.perf_counter()
        for at in range(0, prompt, chunk):
            model(tokens[:, at : at + chunk], cache=cache)
            mx.eval([a for c in cache for a in (c.keys, c.values)])
        times.append(time.perf_counter() - tic)
    return sorted(times[1:])[len(times[1:]) // 4]  # the lower quartile (a shared machine)


def prefill_attention(model: Any, prompt: int, repeat: int) -> float:
    """Seconds of every layer's causal attention over a whole ``prompt`` at once."""
    import mlx.core as mx

    a = model.args
    heads, kv = a.num_attention_heads, a.num_key_value_heads
    dim = getattr(a, "head_dim", None) or a.hidden_size // heads
    q = mx.random.normal((1, heads, prompt, dim))
    k, v = (mx.random.normal((1, kv, prompt, dim)) for _ in range(2))
    mx.eval(q, k, v)

    def build() -> list[Any]:
        return [
            mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask="causal")
            for _ in range(a.num_hidden_layers)
        ]

    return median_seconds(build, repeat, quartile=True)


# -- ceilings ---------------------------------------------------------------------------------
def gemm_rate(rows: int, inner: int, outer: int, repeat: int) -> float:
    """GFLOP/s of a float32 ``[rows, inner] @ [inner, outer]``."""
    import mlx.core as mx

    a, b = mx.random.normal((rows, inner)), mx.random.normal((inner, outer))
    mx.eval(a, b)
    return 2 * rows * inner * outer / median_seconds(lambda: a @ b, repeat, quartile=True) / 1e9


def copy_rate(repeat: int) -> float:
    """GB/s of a float32 ``x + 1`` over 256 MiB (read and written once)."""
    import mlx.core as mx

    x = mx.zeros((64 * 2**20,))
    mx.eval(x)
    return 2 * x.nbytes / median_seconds(lambda: x + 1, repeat, quartile=True) / 1e9


def exp_cost(repeat: int) -> float:
    """Seconds per element of MLX's float32 ``exp`` over 16 Mi values (a softmax's core:
    on this backend it runs on the stream's one thread)."""
    import mlx.core as mx

    x = mx.random.normal((16 * 2**20,))
    mx.eval(x)
    return median_seconds(lambda: mx.exp(x), repeat, quartile=True) / x.size


# -- main -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from common import load_as_worker, set_up_like_mlxq

    set_up_like_mlxq()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF (default: the test tier's SmolLM2-135M Q4_1)")
    ap.add_argument("--rows", default="16,128", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=200, help="prompt tokens a decoding row holds")
    ap.add_argument("--steps", type=int, default=20, help="engine steps timed")
    ap.add_argument("--prompt", type=int, default=1480, help="prefill: one prompt of this length")
    ap.add_argument("--chunks", default="256,512,1024,2048", help="prefill chunk sizes")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dequantize", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--quantized", action="store_true", help="also MLX's quantized matmul")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="top N host functions")
    ap.add_argument("--llama-gen", type=float, help="llama-server's gen tok/s (chat256)")
    ap.add_argument("--llama-total", type=float, help="its prompt+gen tok/s (long prompts)")
    ap.add_argument("--skip", default="", help="comma-separated: decode, prefill, ceilings")
    args = ap.parse_args(argv)
    quiet_logs()
    import mlx.core as mx
    from llama_server import default_gguf
    from mlx.utils import tree_flatten

    gguf = args.model or default_gguf()
    model, tokenizer, _ = load_as_worker(gguf, args.dequantize)
    mx.eval(model.parameters())
    tokenizer.eos_token_ids = []  # every row decodes every step
    a = model.args
    params = tree_flatten(model.parameters())
    weight_bytes = sum(v.nbytes for _, v in params)
    dtypes = sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in params})
    proj_flops, head_flops = flops_per_token(model)
    skip = set(args.skip.split(","))
    print(
        f"{Path(gguf).name} on {describe_device()}, commit {git_commit()}: {a.num_hidden_layers} "
        f"layers, hidden {a.hidden_size}, vocab {a.vocab_size:,}; weights {'/'.join(dtypes)} "
        f"{weight_bytes / 2**30:.2f} GiB; {proj_flops / 1e6:.0f} MFLOP of projections + "
        f"{head_flops / 1e6:.0f} of LM head a token"
    )
    repeat = args.repeat
    rates: dict[str, float] = {}
    if "ceilings" not in skip:
        for rows in map(int, args.rows.split(",")):
            rates[f"gemm {rows}x{a.hidden_size}x{a.intermediate_size}"] = gemm_rate(
                rows, a.hidden_size, a.intermediate_size, repeat
            )
        rates[f"gemm {args.prompt}x{a.hidden_size}x{a.intermediate_size}"] = gemm_rate(
            args.prompt, a.hidden_size, a.intermediate_size, repeat
        )
        rates["copy GB/s"] = copy_rate(repeat)
        rates["exp ns"] = exp_cost(repeat) * 1e9
        print("this CPU: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
              + " (GEMM in GFLOP/s, exp in ns an element)")  # fmt: skip

    decode_rows: list[list[str]] = []
    per_token: dict[int, list[float]] = {}
    prefill_parts: tuple[float, float, float] | None = None
    if "decode" not in skip:
        quantized = None
        if args.quantized:
            quantized, _, _ = load_as_worker(gguf, "off")
        layers = projections(model)
        for rows in map(int, args.rows.split(",")):
            run = engine_steps(model, tokenizer, rows, args.context, args.steps, args.cprofile)
            proj = time_projections(layers, rows, repeat)
            head = time_head(model, rows, repeat)
            attn = time_attention(model, rows, args.context, repeat)
            samp = time_sampling(a.vocab_size, rows, repeat)
            lse = time_logprobs(a.vocab_size, rows, repeat)
            elem = time_elementwise(model, rows, repeat)
            one_op = op_cost(rows, a.hidden_size, repeat)
            step, host = run["step"], run["host"]
            rest = step - host - proj - head - attn - samp - elem
            q = None
            if quantized is not None:
                q = time_projections(projections(quantized)[:1], rows, 1) * a.num_hidden_layers
            gflops = rows * (proj_flops + head_flops) / (proj + head) / 1e9
            parts = (proj + head, attn, samp, elem, host)
            per_token[rows] = [v / rows * 1e3 for v in (*parts, sum(parts), step)]
            decode_rows.append([
                f"{rows}", fmt_num(step * 1e3), fmt_num(host * 1e3), fmt_num(proj * 1e3),
                fmt_num(q * 1e3 if q else None), fmt_num(head * 1e3), fmt_num(attn * 1e3),
                fmt_num(samp * 1e3), fmt_num(elem * 1e3), fmt_num(rest * 1e3),
                f"{one_op * 1e6:.1f}",
                fmt_num(gflops), fmt_num(rows / step), fmt_num((proj + head) / rows * 1e3, 2),
                fmt_num(lse * 1e3),
            ])  # fmt: skip
            if "profile" in run:
                print(f"cProfile of {args.steps} steps at {rows} rows (own time):")
                print(_trim(run["profile"]))
        ops = forward_ops(model, 16, args.context)
        head_names = DECODE_COLUMNS
        print(
            f"\ndecode step, ms (rows of ~{args.context} positions; the engine's step over "
            f"{args.steps} steps, its parts alone; elementwise: norms, RoPE, SiLU, residuals; "
            f"rest = step - the others: cache writes, masks, reshapes and MLX's cost per op, "
            f"{ops:,} ops in one forward's graph; +logprobs: what a step whose rows ask "
            f"for logprobs adds):"
        )
        print(table(head_names, decode_rows))

    if "prefill" not in skip:
        out = []
        for chunk in map(int, args.chunks.split(",")):
            s = prefill_seconds(model, args.prompt, chunk, max(1, repeat // 2))
            out.append([f"{chunk}", fmt_num(s * 1e3), fmt_num(args.prompt / s)])
        proj = time_projections(projections(model), args.prompt, max(1, repeat // 2))
        attn = prefill_attention(model, args.prompt, max(1, repeat // 2))
        best = min(float(r[1].replace(",", "")) for r in out) / args.prompt
        prefill_parts = (proj * 1e3 / args.prompt, attn * 1e3 / args.prompt, best)
        print(f"\nprefill of one {args.prompt}-token prompt:")
        print(table(["chunk", "ms", "tok/s"], out))
        # MLX's CPU attention is composed ops: every score of the square is computed and
        # exponentiated, the causal half masked, not skipped.
        exps = a.num_attention_heads * args.prompt**2 * a.num_hidden_layers
        exp_ms = f"{exps * rates['exp ns'] / 1e6:,.0f} ms" if "exp ns" in rates else "-"
        print(
            f"whole prompt alone: projections {proj * 1e3:,.0f} ms "
            f"({args.prompt * proj_flops / proj / 1e9:.1f} GFLOP/s), causal attention "
            f"{attn * 1e3:,.0f} ms ({exps / 1e6:,.0f} M scores; their exp alone {exp_ms})"
        )

    if per_token and args.llama_gen:
        print(
            f"\nthe bound, ms per generated token (each part alone at its rows; llama-server's "
            f"whole token at {args.llama_gen:g} gen tok/s: {1e3 / args.llama_gen:.2f} ms):"
        )
        cols = ["rows", "GEMM", "attention", "sampling", "elementwise", "host", "sum", "step"]
        llama_ms = 1e3 / args.llama_gen
        body = [
            [str(r), *(fmt_num(v, 2) for v in parts), *(f"{v / llama_ms:.2f}x" for v in parts[5:])]
            for r, parts in per_token.items()
        ]
        print(table([*cols, "sum / llama", "step / llama"], body))
    if prefill_parts and args.llama_total:
        proj_ms, attn_ms, best_ms = prefill_parts
        print(
            f"prefill, ms per prompt token: projections {proj_ms:.2f} + causal attention "
            f"{attn_ms:.2f} (whole prompt), best chunk {best_ms:.2f}; llama-server's whole "
            f"token at {args.llama_total:g} prompt+gen tok/s: {1e3 / args.llama_total:.2f}"
        )
    return 0


def _trim(text: str) -> str:
    """pstats' table without its preamble."""
    lines = text.strip().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:])


if __name__ == "__main__":
    sys.exit(main())
