"""Generation throughput of mlxq next to plain mlx-lm, on the same model and requests.

Modes (all greedy, all forced to generate ``max_tokens``: EOS ids are switched off):

- ``naive``: one request at a time with ``mlx_lm.stream_generate``;
- ``batch_generate``: ``mlx_lm.batch_generate`` with its default batch sizes;
- ``raw``: ``mlx_lm``'s ``BatchGenerator`` at mlxq's batch size, everything inserted up
  front and drained with ``next()`` (the ceiling for mlxq's engine);
- ``mlxq``: end to end through Redis: submit, an ``MlxqWorker`` in burst mode on this
  process's main thread (the engine runs the in-memory model on the Runner's thread),
  results read back; timed from the start of the submit to the last result read. On the
  ``prefix`` workload, ``--prefix-cache on|both`` also (or only) runs it with the engine's
  prefix cache (row ``mlxq+prefix``); its prompt tok/s is effective: the requests'
  prompt tokens over the engine's prefill time.

Usage: ``python bench/throughput.py --preset llama-3.2-1b --workload all``
(see bench/README.md). Writes nothing unless ``--json PATH`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    BENCH_RESULT_TTL,
    Stopwatch,
    bench_queue,
    describe_device,
    drop_batch,
    fmt_num,
    fmt_ratio,
    quiet_logs,
    rate,
    redis_url,
    table,
    use_openblas,
    work_burst,
    write_json,
)
from workloads import SEED, WORKLOADS, Workload, context_per_token, make_workload, step_bound

MODES = ("naive", "batch_generate", "raw", "mlxq", "mlxq-bg")
# --prefix-cache: the engine's prefix cache gets this share of the scheduler's KV budget.
PREFIX_CACHE_SHARE = 0.1
# --workload realistic: the headline workloads and their uniform twins.
REALISTIC = ("varied", "varied-twin", "mixed", "mixed-twin")


# -- model -------------------------------------------------------------------------------
def preset_tokenizer() -> Any:
    """The presets' tokenizer as mlx-lm's ``TokenizerWrapper``, built in memory."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    from mlxq.engine.make_model import BOS, CHAT_TEMPLATE, END, EOS_IDS, EOT, build_tokenizer

    hf = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), bos_token=BOS, eos_token=EOT, pad_token=END
    )
    hf.chat_template = CHAT_TEMPLATE
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=EOS_IDS)


def load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """``(model, tokenizer, name)``: a random-weight preset built in memory, or ``--model``;
    quantized with ``--quantize``, then in the weight format mlxq's worker would pick
    (``--dequantize``, :func:`mlxq.engine.weights.prepare_weights`) for every mode."""
    from mlxq.engine.hardware import device_facts
    from mlxq.engine.weights import prepare_weights

    if args.model:
        import mlx_lm

        model, tokenizer = mlx_lm.load(args.model)[:2]
        name = Path(args.model.rstrip("/")).name or args.model
    else:
        from mlxq.engine.make_model import build_model

        model, _ = build_model(args.preset, seed=SEED)
        tokenizer, name = preset_tokenizer(), args.preset
    if args.quantize:
        import mlx.nn as nn

        nn.quantize(model, group_size=64, bits=args.quantize)
        name += f"-{args.quantize}bit"
    facts = device_facts()
    model = prepare_weights(model, facts.backend, facts.memory_bytes, args.dequantize)
    return model, tokenizer, name


def token_pool(tokenizer: Any, vocab_size: int) -> list[int]:
    """Ids prompts are drawn from: in both vocabularies, no special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    special |= set(tokenizer.eos_token_ids)
    return [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]


# -- results -----------------------------------------------------------------------------
@dataclass
class ModeResult:
    """One mode's figures on one workload."""

    mode: str
    wall_s: float
    gen_tokens: int  # generated tokens counted (naive: of the timed requests only)
    prompt_tokens: int
    prompt_tps: float | None
    peak_gb: float | None = None
    timed_requests: int | None = None  # naive: requests actually run, when extrapolated
    expected_gen_tokens: int = 0
    errors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def extrapolated(self) -> bool:
        return self.timed_requests is not None

    @property
    def gen_tps(self) -> float | None:
        total = self.expected_gen_tokens if self.extrapolated else self.gen_tokens
        return rate(total, self.wall_s)


def _peak_gb() -> float | None:
    import mlx.core as mx

    try:
        return mx.get_peak_memory() / 1e9
    except Exception:  # not every backend reports it
        return None


def _fresh() -> None:
    """Release what the previous mode left: cached buffers and the peak-memory mark."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


# -- modes -------------------------------------------------------------------------------
def run_naive(model: Any, tokenizer: Any, wl: Workload, limit: int) -> ModeResult:
    """One request at a time; with ``limit`` only the first requests, then extrapolate.

    The estimate for all requests is prompt tokens at the measured prefill rate plus
    generated tokens at the measured decode rate (both from the timed requests).
    """
    from mlx_lm import stream_generate

    n = len(wl.prompts)
    k = n if limit <= 0 else min(limit, n)
    prefill_s = decode_s = 0.0
    gen = prompt = 0
    clock = Stopwatch()
    for tokens, max_tokens in zip(wl.prompts[:k], wl.max_tokens[:k], strict=True):
        t0 = time.perf_counter()
        last = None
        for response in stream_generate(model, tokenizer, tokens, max_tokens=max_tokens):
            last = response
        assert last is not None
        seconds = time.perf_counter() - t0
        p_s = last.prompt_tokens / last.prompt_tps  # prefill + first token
        prefill_s, decode_s = prefill_s + p_s, decode_s + seconds - p_s
        gen, prompt = gen + last.generation_tokens, prompt + last.prompt_tokens
    wall = clock.stop()
    result = ModeResult("naive", wall, gen, prompt, rate(prompt, prefill_s), _peak_gb())
    result.expected_gen_tokens = wl.gen_tokens
    if k < n:
        result.timed_requests = k
        result.extra = {"timed_wall_s": wall, "timed_gen_tokens": gen}
        per_prompt = prefill_s / prompt if prompt else 0.0
        per_gen = decode_s / gen if gen else 0.0
        result.wall_s = wl.prompt_tokens * per_prompt + wl.gen_tokens * per_gen
        result.prompt_tokens = wl.prompt_tokens
    return result


def run_batch_generate(model: Any, tokenizer: Any, wl: Workload) -> ModeResult:
    """``mlx_lm.batch_generate`` with its default batch sizes."""
    from mlx_lm import batch_generate

    clock = Stopwatch()
    out = batch_generate(
        model, tokenizer, wl.prompts, max_tokens=list(wl.max_tokens), return_token_ids=True
    )
    wall = clock.stop()
    gen = sum(len(t) for t in out.token_ids or [])
    result = ModeResult("batch_generate", wall, gen, wl.prompt_tokens, out.stats.prompt_tps)
    result.peak_gb, result.expected_gen_tokens = _peak_gb(), wl.gen_tokens
    return result


def run_raw(model: Any, wl: Workload, batch: int, prefill_batch: int, prefill_step: int):
    """``BatchGenerator`` at mlxq's sizes: all requests inserted up front, drained."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import greedy_sampler

    gen = BatchGenerator(
        model,
        stop_tokens=None,
        sampler=greedy_sampler,
        completion_batch_size=batch,
        prefill_batch_size=prefill_batch,
        prefill_step_size=prefill_step,
    )
    n, finished, tokens = len(wl.prompts), 0, 0
    try:
        clock = Stopwatch()
        with gen.stats() as stats:
            gen.insert(wl.prompts, list(wl.max_tokens))
            while finished < n:
                prompt_responses, responses = gen.next()
                if not prompt_responses and not responses:
                    break  # nothing left to do (should not happen)
                tokens += len(responses)
                finished += sum(r.finish_reason is not None for r in responses)
        wall = clock.stop()
    finally:
        gen.close()
    result = ModeResult("raw", wall, tokens, wl.prompt_tokens, stats.prompt_tps, _peak_gb())
    result.expected_gen_tokens = wl.gen_tokens
    result.errors = n - finished
    return result


# The engine's counts each mlxq row reports (EngineStats fields).
WORK_STATS = (
    "prefilled_tokens",
    "prefill_calls",
    "decode_seconds",
    "decode_steps",
    "launch_seconds",
)
PREFIX_STATS = ("prefix_hits", "reused_tokens", "stored_tokens", "prefix_evictions")


def run_mlxq(
    model: Any,
    tokenizer: Any,
    name: str,
    wl: Workload,
    profile: Any,
    url: str,
    prefix_cache_bytes: int = 0,
    engine: str = "slot",
):
    """Submit, run a burst worker on the main thread, read every result back.

    ``engine``: "slot" (mlxq's default engine) or "batch_generator" (mode ``mlxq-bg``).

    The prompt tok/s is effective: the requests' prompt tokens over the engine's prefill
    time (``Engine.stats()``), so prompt tokens taken from the prefix cache count too.
    """
    from mlxq.broker.batches import connect, iter_batch_results, submit
    from mlxq.engine.model_facts import model_info
    from mlxq.engine.protocol import BatchEngine
    from mlxq.engine.runner import Runner
    from mlxq.wire import Request
    from mlxq.worker.config import resolve
    from mlxq.worker.launch import build_scheduler, engine_for
    from mlxq.worker.rq_worker import MlxqWorker

    readings: dict[str, Any] = {}
    configs: list[Any] = []
    kind = engine

    def make_engine(facts: Any) -> BatchEngine:  # as mlxq.worker.launch.Setup, loaded model
        info = model_info(model, name, vocab_size=len(tokenizer))
        config = dataclasses.replace(
            resolve(profile, facts, info), prefix_cache_bytes=prefix_cache_bytes
        )
        configs.append(config)
        engine = engine_for(model, tokenizer, config, engine=kind)
        readings["start"] = engine.stats()
        return engine

    runner = Runner(make_engine, lambda engine, facts: build_scheduler(configs[0]))
    runner.start()
    conn = connect(url)
    queue = bench_queue()
    requests = [
        Request(prompt=p, max_tokens=m) for p, m in zip(wl.prompts, wl.max_tokens, strict=True)
    ]
    worker = MlxqWorker([queue], connection=conn, runner=runner, model_name=name)
    try:
        clock = Stopwatch()
        batch = submit(conn, requests, queue=queue, result_ttl=BENCH_RESULT_TTL)
        submit_s = clock.stop()
        work_s, exit_s = work_burst(worker)
        clock = Stopwatch()
        results = list(iter_batch_results(conn, batch.batch_id))
        read_s = clock.stop()
        drop_batch(conn, batch.batch_id, queue)
    finally:
        runner.stop()
        conn.close()
    wall = submit_s + work_s + read_s
    done = [r for r in results if r is not None and r.finish_reason in ("length", "stop")]
    gen = sum(r.usage.completion_tokens for r in done)
    done_work = runner.engine.stats().since(readings["start"])
    prefill_s = done_work.prefill_seconds
    mode = ("mlxq" if engine == "slot" else "mlxq-bg") + ("+prefix" if prefix_cache_bytes else "")
    result = ModeResult(mode, wall, gen, wl.prompt_tokens, rate(wl.prompt_tokens, prefill_s))
    result.peak_gb = _peak_gb()
    result.expected_gen_tokens, result.errors = wl.gen_tokens, len(results) - len(done)
    result.extra = {"submit_s": submit_s, "worker_s": work_s, "read_s": read_s}
    result.extra["worker_exit_s"] = exit_s
    result.extra["prefill_s"] = prefill_s
    keep = WORK_STATS
    if prefix_cache_bytes:
        result.extra["prefix_cache_bytes"] = prefix_cache_bytes
        keep += PREFIX_STATS
    result.extra.update({k: getattr(done_work, k) for k in keep})
    return result


def median_run(runs: list[ModeResult]) -> ModeResult:
    """The run with the median wall time (the slower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    chosen = ordered[len(ordered) // 2]
    if len(runs) > 1:
        chosen.extra["repeat_wall_s"] = [round(r.wall_s, 4) for r in runs]
    return chosen


# -- report ------------------------------------------------------------------------------
def model_line(info: Any) -> str:
    size = info.param_bytes / 2**30
    return (
        f"model {info.name} ({info.model_type}, {info.num_layers} layers, hidden "
        f"{info.hidden_size}, {info.dtype}, {size:.2f} GiB)"
    )


def report(header: str, results: list[ModeResult], wl: Workload) -> str:
    by_mode = {r.mode: r for r in results}
    base_bg = by_mode["batch_generate"].gen_tps if "batch_generate" in by_mode else None
    base_raw = by_mode["raw"].gen_tps if "raw" in by_mode else None
    headers = ["mode", "gen tok/s", "prompt tok/s", "wall s", "gen tokens", "peak GB"]
    headers += ["vs batch_generate", "vs raw"]
    rows, notes = [], []
    for r in results:
        mark = "*" if r.extrapolated else ""
        if not r.extrapolated and (r.gen_tokens != r.expected_gen_tokens or r.errors):
            mark = "!"
            notes.append(
                f"! {r.mode}: generated {r.gen_tokens:,} of {r.expected_gen_tokens:,} "
                f"expected tokens, {r.errors} requests failed or unfinished"
            )
        rows.append(
            [
                r.mode + mark,
                fmt_num(r.gen_tps),
                fmt_num(r.prompt_tps),
                fmt_num(r.wall_s, 2),
                f"{r.gen_tokens:,}",
                fmt_num(r.peak_gb, 2),
                fmt_ratio(r.gen_tps, base_bg),
                fmt_ratio(r.gen_tps, base_raw),
            ]
        )
        if r.extrapolated:
            notes.append(
                f"* {r.mode}: timed on the first {r.timed_requests} of {len(wl.prompts)} "
                f"requests ({r.extra['timed_gen_tokens']:,} tokens in "
                f"{r.extra['timed_wall_s']:.2f} s); wall s and gen tok/s are extrapolated to "
                f"all {wl.gen_tokens:,} tokens from its prefill and decode rates"
            )
        if r.mode.startswith("mlxq"):
            e = r.extra
            notes.append(
                f"  {r.mode}: submit {e['submit_s']:.2f} s + worker {e['worker_s']:.2f} s + "
                f"read results {e['read_s']:.2f} s (then the worker's exit, not counted: "
                f"{e['worker_exit_s']:.2f} s)"
            )
            if e.get("decode_steps"):  # the slot engine: where the worker's time went
                notes.append(
                    f"  {r.mode}: prefill {e['prefill_s']:.2f} s in {e['prefill_calls']:,} calls, "
                    f"{e['decode_steps']:,} decode "
                    f"steps {e['decode_seconds']:.2f} s (building and launching them on the "
                    f"host {e['launch_seconds']:.2f} s), the rest outside the engine "
                    f"{e['worker_s'] - e['prefill_s'] - e['decode_seconds']:.2f} s"
                )
    if (off := by_mode.get("mlxq")) and (on := by_mode.get("mlxq+prefix")):
        e = on.extra
        notes.append(
            f"  prefix cache ({e['prefix_cache_bytes'] / 2**20:.0f} MiB): effective prompt "
            f"tok/s {fmt_num(off.prompt_tps)} -> {fmt_num(on.prompt_tps)} "
            f"({fmt_ratio(on.prompt_tps, off.prompt_tps)}); prefilled "
            f"{off.extra['prefilled_tokens']:,} -> {e['prefilled_tokens']:,} tokens, "
            f"{e['reused_tokens']:,} reused in {e['prefix_hits']} hits, "
            f"{e['stored_tokens']:,} stored, {e['prefix_evictions']} evictions"
        )
    lines = [header, table(headers, rows), *notes]
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from mlxq.engine.make_model import PRESETS

    ap = argparse.ArgumentParser(
        description="Generation throughput: naive, batch_generate, raw BatchGenerator, mlxq.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="random-weight model built in memory",
    )
    src.add_argument("--model", help="a model folder or hub id for mlx_lm.load instead")
    ap.add_argument(
        "--workload",
        default="uniform",
        help="comma-separated: " + ", ".join(WORKLOADS) + "; 'realistic' (varied and mixed "
        "with their uniform twins) or 'all'",
    )
    ap.add_argument("--requests", type=int, default=256, help="requests per workload")
    ap.add_argument(
        "--queue-factor",
        type=int,
        default=None,
        help="requests = this many times the batch (overrides --requests): a queue deeper "
        "than the batch, refilled as jobs finish",
    )
    ap.add_argument(
        "--export-jsonl",
        metavar="DIR",
        help="also write each workload as DIR/NAME.jsonl (input for `mlxq run`)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=128, help="uniform: prompt length")
    ap.add_argument(
        "--gen-tokens",
        type=int,
        default=128,
        help="uniform and prefix: max_tokens (always generated in full)",
    )
    ap.add_argument(
        "--prefix-tokens", type=int, default=1000, help="prefix: length of the shared prefix"
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help="mlxq's batch size (also raw's); default: what mlxq picks on this "
        "device (build_scheduler / auto_max_batch)",
    )
    ap.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES)
    )
    ap.add_argument(
        "--naive-requests",
        type=int,
        default=16,
        help="naive: time only the first N requests and extrapolate (0: all)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each mode this many times and report the median-wall run",
    )
    ap.add_argument(
        "--redis-url",
        default=None,
        help="mlxq mode: this Redis instead of an embedded Valkey (a private "
        "queue is used; jobs expire after 10 minutes)",
    )
    ap.add_argument(
        "--prefix-cache",
        default="off",
        choices=("off", "on", "both"),
        help="prefix workload, mlxq mode: run with the engine's prefix cache off, on "
        f"({PREFIX_CACHE_SHARE:.0%}% of the KV budget), or both, with the prompt tok/s ratio",
    )
    ap.add_argument(
        "--prefill-batch",
        type=int,
        help="mlxq's (and raw's) prefill batch size (default: the worker's default)",
    )
    ap.add_argument(
        "--quantize", type=int, choices=(4, 8), help="quantize the weights to this many bits"
    )
    ap.add_argument(
        "--no-warm-modes",
        dest="warm_modes",
        action="store_false",
        help="skip the untimed run of every mode on a short copy of each workload",
    )
    ap.add_argument(
        "--kv-bits", type=int, choices=(4, 8), help="mlxq modes: a quantized slot KV cache"
    )
    ap.add_argument(
        "--dequantize",
        default="auto",
        choices=("auto", "on", "off"),
        help="quantized weights at load, as the worker's --dequantize (auto: dequantized on "
        "CUDA when they fit); applies to every mode",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = sorted(set(modes) - set(MODES))
    if bad or not modes:
        ap.error(f"--modes: unknown {', '.join(bad) or '(none given)'}; choose from {MODES}")
    args.modes = [m for m in MODES if m in modes]
    names = [w.strip() for w in args.workload.split(",") if w.strip()]
    expand = {"all": WORKLOADS, "realistic": REALISTIC}
    args.workloads = [w for n in names for w in expand.get(n, (n,))]
    if not args.workloads or (bad := sorted(set(args.workloads) - set(WORKLOADS))):
        ap.error(f"--workload: unknown {args.workload!r}; choose from {WORKLOADS}")
    if args.queue_factor is not None and args.queue_factor < 1:
        ap.error("--queue-factor must be at least 1")
    if args.requests < 1 or args.prompt_tokens < 1 or args.gen_tokens < 1:
        ap.error("--requests, --prompt-tokens and --gen-tokens must be at least 1")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.batch is not None and args.batch < 1:
        ap.error("--batch must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    use_openblas()
    args = parse_args(argv)
    quiet_logs()

    from mlx_lm import stream_generate
    from mlx_lm.generate import BatchGenerator

    from mlxq.engine.hardware import device_facts
    from mlxq.engine.model_facts import model_info
    from mlxq.engine.scheduler import auto_prefill_batch
    from mlxq.worker.config import resolve
    from mlxq.worker.launch import build_scheduler
    from mlxq.worker.profile import WorkerProfile

    clock = Stopwatch()
    model, tokenizer, name = load(args)
    info = model_info(model, name, vocab_size=len(tokenizer))
    pool = token_pool(tokenizer, info.vocab_size)
    tokenizer.eos_token_ids = []  # every mode generates max_tokens: no EOS stops
    print(f"loaded {name} in {clock.stop():.1f} s", file=sys.stderr)

    # mlxq's own sizing: the scheduler's batch is what the worker admits.
    sizes = {"prefill_batch": args.prefill_batch} if args.prefill_batch else {}
    profile = WorkerProfile(max_batch=args.batch, kv_bits=args.kv_bits, **sizes)
    scheduler = build_scheduler(resolve(profile, device_facts(), info))
    batch = scheduler.max_batch

    # mlxq's prefill batch: as given, or what its scheduler picks for a workload's prompts
    # (the raw BatchGenerator runs with the same, so the two compare like for like).
    def prefill_for(wl: Workload) -> int:
        lengths = [len(p) for p in wl.prompts]
        step, tokens = profile.prefill_step, scheduler.prefill_tokens
        return profile.prefill_batch or auto_prefill_batch(lengths, batch, step, tokens)

    how = "given" if args.batch else "auto"
    defaults = inspect.signature(BatchGenerator.__init__).parameters
    bg_batch = defaults["completion_batch_size"].default
    bg_prefill = defaults["prefill_batch_size"].default

    n = args.requests if args.queue_factor is None else args.queue_factor * batch
    workloads = [make_workload(k, args, pool, n) for k in args.workloads]
    if args.export_jsonl:
        export_jsonl(workloads, Path(args.export_jsonl))
    for wl in workloads:
        longest = max(len(p) + m for p, m in zip(wl.prompts, wl.max_tokens, strict=True))
        if longest > info.context_length:
            sys.exit(
                f"{wl.name}: a request needs {longest} tokens but the context of {name} "
                f"is {info.context_length}: lower the lengths"
            )

    # Warm-up: compile and allocate once, outside every timed mode.
    clock = Stopwatch()
    for _ in stream_generate(model, tokenizer, pool[:32], max_tokens=8):
        pass
    warm = BatchGenerator(model, stop_tokens=None, completion_batch_size=4, prefill_batch_size=4)
    warm.insert([pool[:16], pool[:40], pool[:7], pool[:64]], [8, 8, 8, 8])
    while warm.next_generated():
        pass
    warm.close()
    print(f"warm-up {clock.stop():.1f} s", file=sys.stderr)

    device = describe_device()
    out: dict[str, Any] = {
        "model": {**_struct_dict(info)},
        "device": device,
        "mlxq_batch": batch,
        "mlxq_batch_source": how,
        "prefill_batch": profile.prefill_batch or "auto",
        "prefill_step": profile.prefill_step,
        "batch_generate_defaults": {
            "completion_batch_size": bg_batch,
            "prefill_batch_size": bg_prefill,
        },
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "workloads": [],
    }
    queued = any(m.startswith("mlxq") for m in args.modes)
    server = redis_url(args.redis_url) if queued else contextlib.nullcontext("")
    with server as url:
        variants = {wl.name: _variants(wl, args, scheduler.budget_bytes) for wl in workloads}

        from mlxq.engine.fused_projections import unfuse_projections

        def run_one(wl: Workload, mode: str, cache_bytes: int) -> ModeResult:
            if not mode.startswith("mlxq"):  # mlx-lm's modes run the model as it built it
                unfuse_projections(model)  # (an mlxq engine fuses it in place on CUDA)
            if mode == "naive":
                return run_naive(model, tokenizer, wl, args.naive_requests)
            if mode == "batch_generate":
                return run_batch_generate(model, tokenizer, wl)
            if mode == "raw":
                return run_raw(model, wl, batch, prefill_for(wl), profile.prefill_step)
            engine = "slot" if mode == "mlxq" else "batch_generator"
            return run_mlxq(model, tokenizer, name, wl, profile, url, cache_bytes, engine)

        # Each mode once, untimed, on a short copy of every workload (its prompts, 8 tokens
        # each): a GPU compiles kernels for the first steps of each new shape, and whichever
        # mode ran first would pay for them inside its timing.
        if args.warm_modes:
            clock = Stopwatch()
            for wl in workloads:
                short = dataclasses.replace(wl, max_tokens=[min(8, m) for m in wl.max_tokens])
                for mode, cache_bytes in variants[wl.name]:
                    if mode != "naive":
                        run_one(short, mode, cache_bytes)
            _fresh()
            print(f"modes warmed up in {clock.stop():.1f} s", file=sys.stderr)
        # Repeats go round every workload and mode in turn, so a change in the load of a
        # shared machine hits them alike.
        runs: dict[tuple[str, str, int], list[ModeResult]] = {}
        for i in range(args.repeat):
            for wl in workloads:
                for mode, cache_bytes in variants[wl.name]:
                    _fresh()
                    label = mode + ("+prefix" if cache_bytes else "")
                    print(f"{wl.name}: {label} ({i + 1}/{args.repeat}) ...", file=sys.stderr)
                    key = (wl.name, mode, cache_bytes)
                    runs.setdefault(key, []).append(run_one(wl, mode, cache_bytes))
        for wl in workloads:
            results = [median_run(runs[(wl.name, m, c)]) for m, c in variants[wl.name]]
            header = (
                f"{model_line(info)} on {device} | workload {wl.label} | mlxq batch {batch} "
                f"({how}), prefill batch {prefill_for(wl)} | batch_generate: mlx-lm defaults "
                f"(batch {bg_batch}, prefill batch {bg_prefill})"
            )
            if args.repeat > 1:
                header += f" | median of {args.repeat} runs"
            print()
            print(report(header, results, wl))
            sys.stdout.flush()
            out["workloads"].append(_workload_json(wl, results))
        if twins := twin_ratios(out["workloads"], batch):
            print()
            print(twins)
    _fresh()
    if args.json:
        write_json(args.json, out)
    return 0


def export_jsonl(workloads: list[Workload], folder: Path) -> None:
    """Write each workload's requests as FOLDER/NAME.jsonl, for `mlxq run`."""
    folder.mkdir(parents=True, exist_ok=True)
    for wl in workloads:
        lines = (json.dumps(row) for row in wl.jsonl())
        (folder / f"{wl.name}.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(workloads)} workloads to {folder}/", file=sys.stderr)


def twin_ratios(workloads: list[dict[str, Any]], batch: int) -> str:
    """Each varied workload's gen tok/s over its uniform twin's, mode by mode, and the best
    ratio a fixed cost per decode step allows (:func:`workloads.step_bound`)."""
    by_name = {w["workload"]: {m["mode"]: m["gen_tps"] for m in w["modes"]} for w in workloads}
    bounds = {w["workload"]: step_bound(w["max_tokens"], batch) for w in workloads}
    context = {
        w["workload"]: context_per_token(w["prompt_lengths"], w["max_tokens"]) for w in workloads
    }
    lines = []
    for name, modes in by_name.items():
        twin = by_name.get(f"{name}-twin")
        if twin is None:
            continue
        pairs = [
            f"{mode} {fmt_ratio(tps, twin.get(mode))}"
            for mode, tps in modes.items()
            if mode in twin
        ]
        lines.append(
            f"{name} vs its uniform twin (gen tok/s): " + ", ".join(pairs) + f" (bound at a "
            f"fixed cost per step, batch {batch}: {bounds[name]:.2f}x; positions a token "
            f"attends: {context[name] / context[f'{name}-twin']:.2f}x the twin's, which "
            "costs more where attention is much of a step, as on a CPU)"
        )
    return "\n".join(lines)


def _variants(wl: Workload, args: argparse.Namespace, budget: int) -> list[tuple[str, int]]:
    """(mode, prefix cache bytes) to run on a workload: the cache off (0) and/or on, per
    ``--prefix-cache``, for the mlxq modes on the prefix workload."""
    out = []
    for mode in args.modes:
        caches = [0]
        if mode.startswith("mlxq") and wl.name == "prefix" and args.prefix_cache != "off":
            on = max(1, int(budget * PREFIX_CACHE_SHARE))
            caches = [on] if args.prefix_cache == "on" else [0, on]
        out += [(mode, c) for c in caches]
    return out


def _struct_dict(obj: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(obj)


def _workload_json(wl: Workload, results: list[ModeResult]) -> dict[str, Any]:
    by_mode = {r.mode: r.gen_tps for r in results}
    rows = []
    for r in results:
        row = {
            "mode": r.mode,
            "gen_tps": r.gen_tps,
            "prompt_tps": r.prompt_tps,
            "wall_s": r.wall_s,
            "gen_tokens": r.gen_tokens,
            "expected_gen_tokens": r.expected_gen_tokens,
            "prompt_tokens": r.prompt_tokens,
            "peak_gb": r.peak_gb,
            "errors": r.errors,
            "extrapolated_from_requests": r.timed_requests,
            "vs_batch_generate": _ratio(r.gen_tps, by_mode.get("batch_generate")),
            "vs_raw": _ratio(r.gen_tps, by_mode.get("raw")),
            **r.extra,
        }
        rows.append(row)
    return {
        "workload": wl.name,
        "label": wl.label,
        "requests": len(wl.prompts),
        "max_tokens": wl.max_tokens,
        "prompt_lengths": [len(p) for p in wl.prompts],
        "prompt_tokens": wl.prompt_tokens,
        "gen_tokens": wl.gen_tokens,
        "modes": rows,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


if __name__ == "__main__":
    sys.exit(main())
