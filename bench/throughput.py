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
import inspect
import json
import sys
from pathlib import Path
from typing import Any

from common import (
    Stopwatch,
    describe_device,
    fmt_num,
    fmt_ratio,
    preset_tokenizer,
    quiet_logs,
    redis_url,
    table,
    use_openblas,
    write_json,
)
from modes import (
    ModeResult,
    fresh_memory,
    median_run,
    run_batch_generate,
    run_mlxq,
    run_naive,
    run_raw,
)
from workloads import SEED, WORKLOADS, Workload, context_per_token, make_workload, step_bound

MODES = ("naive", "batch_generate", "raw", "mlxq", "mlxq-bg")
# --prefix-cache: the engine's prefix cache gets this share of the scheduler's KV budget.
PREFIX_CACHE_SHARE = 0.1
# --workload realistic: the headline workloads and their uniform twins.
REALISTIC = ("varied", "varied-twin", "mixed", "mixed-twin")


# -- model -------------------------------------------------------------------------------
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
    bg = batch_generator_defaults()

    n = args.requests if args.queue_factor is None else args.queue_factor * batch
    workloads = [make_workload(k, args, pool, n) for k in args.workloads]
    if args.export_jsonl:
        export_jsonl(workloads, Path(args.export_jsonl))
    check_context(workloads, info.context_length, name)
    warm_up(model, tokenizer, pool)

    device = describe_device()
    out: dict[str, Any] = {
        "model": {**_struct_dict(info)},
        "device": device,
        "mlxq_batch": batch,
        "mlxq_batch_source": how,
        "prefill_batch": profile.prefill_batch or "auto",
        "prefill_step": profile.prefill_step,
        "batch_generate_defaults": {"completion_batch_size": bg[0], "prefill_batch_size": bg[1]},
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

        if args.warm_modes:
            warm_modes(workloads, variants, run_one)
        runs = run_rounds(workloads, variants, args.repeat, run_one)
        for wl in workloads:
            results = [median_run(runs[(wl.name, m, c)]) for m, c in variants[wl.name]]
            header = (
                f"{model_line(info)} on {device} | workload {wl.label} | mlxq batch {batch} "
                f"({how}), prefill batch {prefill_for(wl)} | batch_generate: mlx-lm defaults "
                f"(batch {bg[0]}, prefill batch {bg[1]})"
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
    fresh_memory()
    if args.json:
        write_json(args.json, out)
    return 0


def batch_generator_defaults() -> tuple[int, int]:
    """mlx-lm's ``BatchGenerator`` default completion and prefill batch sizes (what
    ``batch_generate`` runs with)."""
    from mlx_lm.generate import BatchGenerator

    defaults = inspect.signature(BatchGenerator.__init__).parameters
    return defaults["completion_batch_size"].default, defaults["prefill_batch_size"].default


def check_context(workloads: list[Workload], context_length: int, name: str) -> None:
    """Exit with a message if a request does not fit the model's context."""
    for wl in workloads:
        longest = max(len(p) + m for p, m in zip(wl.prompts, wl.max_tokens, strict=True))
        if longest > context_length:
            sys.exit(
                f"{wl.name}: a request needs {longest} tokens but the context of {name} "
                f"is {context_length}: lower the lengths"
            )


def warm_up(model: Any, tokenizer: Any, pool: list[int]) -> None:
    """Compile and allocate once, outside every timed mode."""
    from mlx_lm import stream_generate
    from mlx_lm.generate import BatchGenerator

    clock = Stopwatch()
    for _ in stream_generate(model, tokenizer, pool[:32], max_tokens=8):
        pass
    warm = BatchGenerator(model, stop_tokens=None, completion_batch_size=4, prefill_batch_size=4)
    warm.insert([pool[:16], pool[:40], pool[:7], pool[:64]], [8, 8, 8, 8])
    while warm.next_generated():
        pass
    warm.close()
    print(f"warm-up {clock.stop():.1f} s", file=sys.stderr)


def warm_modes(
    workloads: list[Workload], variants: dict[str, list[tuple[str, int]]], run_one: Any
) -> None:
    """Each mode once, untimed, on a short copy of every workload (its prompts, 8 tokens
    each): a GPU compiles kernels for the first steps of each new shape, and whichever
    mode ran first would pay for them inside its timing."""
    clock = Stopwatch()
    for wl in workloads:
        short = dataclasses.replace(wl, max_tokens=[min(8, m) for m in wl.max_tokens])
        for mode, cache_bytes in variants[wl.name]:
            if mode != "naive":
                run_one(short, mode, cache_bytes)
    fresh_memory()
    print(f"modes warmed up in {clock.stop():.1f} s", file=sys.stderr)


def run_rounds(
    workloads: list[Workload],
    variants: dict[str, list[tuple[str, int]]],
    repeat: int,
    run_one: Any,
) -> dict[tuple[str, str, int], list[ModeResult]]:
    """Every (workload, mode, prefix cache bytes) ``repeat`` times, keyed so. Repeats go
    round every workload and mode in turn, so a change in the load of a shared machine
    hits them alike."""
    runs: dict[tuple[str, str, int], list[ModeResult]] = {}
    for i in range(repeat):
        for wl in workloads:
            for mode, cache_bytes in variants[wl.name]:
                fresh_memory()
                label = mode + ("+prefix" if cache_bytes else "")
                print(f"{wl.name}: {label} ({i + 1}/{repeat}) ...", file=sys.stderr)
                key = (wl.name, mode, cache_bytes)
                runs.setdefault(key, []).append(run_one(wl, mode, cache_bytes))
    return runs


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
