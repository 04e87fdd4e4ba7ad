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

``--batch 256,512,auto`` runs ``raw`` and the mlxq modes at each batch size, side by side
on one workload, with a sweep table (:mod:`throughput_sweep`).

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
    preset_tokenizer,
    quiet_logs,
    redis_url,
    set_up_like_mlxq,
    write_json,
)
from modes import (
    ModeResult,
    fresh_memory,
    median_run,
    run_batch_generate,
    run_mlxq,
    run_mlxq_direct,
    run_naive,
    run_raw,
)
from throughput_args import PREFIX_CACHE_SHARE, parse_args
from throughput_report import (
    model_line,
    report,
    struct_dict,
    sweep_report,
    twin_ratios,
    workload_json,
)
from throughput_sweep import Sizing, Variant, make_sizes, variants_of
from workloads import SEED, Workload, make_workload


# -- model -------------------------------------------------------------------------------
def load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """``(model, tokenizer, name)``: a random-weight preset built in memory, or ``--model``;
    quantized with ``--quantize``, then in the weight format mlxq's worker would pick
    (``--dequantize``, :func:`mlxq.engine.models.weights.prepare_weights`) for every mode."""
    from mlxq.engine.hardware import device_facts
    from mlxq.engine.models.weights import prepare_weights

    if args.model:
        import mlx_lm

        model, tokenizer = mlx_lm.load(args.model)[:2]
        name = Path(args.model.rstrip("/")).name or args.model
    else:
        from mlxq.engine.models.make import build_model

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


# -- main -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    set_up_like_mlxq()
    args = parse_args(argv)
    quiet_logs()

    from mlxq.engine.models.facts import model_info
    from mlxq.engine.scheduler import auto_prefill_batch

    clock = Stopwatch()
    model, tokenizer, name = load(args)
    info = model_info(model, name, vocab_size=len(tokenizer))
    pool = token_pool(tokenizer, info.vocab_size)
    tokenizer.eos_token_ids = []  # every mode generates max_tokens: no EOS stops
    print(f"loaded {name} in {clock.stop():.1f} s", file=sys.stderr)

    # mlxq's own sizing at each --batch size: the scheduler's batch is what the worker admits.
    sizes = make_sizes(args, info)
    sweep = len(sizes) > 1
    for size in sizes:
        print(size.why, file=sys.stderr)

    # mlxq's prefill batch: as given, or what its scheduler picks for a workload's prompts
    # (the raw BatchGenerator runs with the same, so the two compare like for like).
    def prefill_for(wl: Workload, size: Sizing) -> int:
        lengths = [len(p) for p in wl.prompts]
        step, tokens = size.profile.prefill_step, size.scheduler.prefill_tokens
        return args.prefill_batch or auto_prefill_batch(lengths, size.batch, step, tokens)

    bg = batch_generator_defaults()
    # One workload for every size: the queue is sized on the widest batch.
    widest = max(s.batch for s in sizes)
    n = args.requests if args.queue_factor is None else args.queue_factor * widest
    workloads = [make_workload(k, args, pool, n) for k in args.workloads]
    if args.export_jsonl:
        export_jsonl(workloads, Path(args.export_jsonl))
    check_context(workloads, info.context_length, name)
    warm_up(model, tokenizer, pool)

    device = describe_device()
    out: dict[str, Any] = {
        "model": {**struct_dict(info)},
        "device": device,
        "mlxq_batch": sizes[0].batch,
        "mlxq_batch_source": sizes[0].source,
        "batches": [{"batch": s.batch, "source": s.source, "why": s.why} for s in sizes],
        "prefill_batch": args.prefill_batch or "auto",
        "prefill_step": sizes[0].profile.prefill_step,
        "batch_generate_defaults": {"completion_batch_size": bg[0], "prefill_batch_size": bg[1]},
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "workloads": [],
    }
    queued = any(m.startswith("mlxq") for m in args.modes)
    server = redis_url(args.redis_url) if queued else contextlib.nullcontext("")
    with server as url:
        budget = sizes[0].scheduler.budget_bytes
        variants = {
            wl.name: variants_of(
                args.modes, sizes, args.prefix_cache, wl.name, budget, PREFIX_CACHE_SHARE
            )
            for wl in workloads
        }

        from mlxq.engine.models.fused_projections import unfuse_projections

        def run_one(wl: Workload, v: Variant) -> ModeResult:
            result = _run_mode(wl, v.mode, v.cache_bytes, sizes[v.size])
            result.mode = v.label(sweep, sizes)
            result.extra["batch"] = sizes[v.size].batch
            return result

        def _run_mode(wl: Workload, mode: str, cache_bytes: int, size: Sizing) -> ModeResult:
            if not mode.startswith("mlxq"):  # mlx-lm's modes run the model as it built it
                unfuse_projections(model)  # (an mlxq engine fuses it in place on CUDA)
            if mode == "naive":
                return run_naive(model, tokenizer, wl, args.naive_requests)
            if mode == "batch_generate":
                return run_batch_generate(model, tokenizer, wl)
            if mode == "raw":
                step = size.profile.prefill_step
                return run_raw(model, wl, size.batch, prefill_for(wl, size), step)
            if mode == "mlxq-direct":
                return run_mlxq_direct(model, tokenizer, name, wl, size.profile)
            engine = "slot" if mode == "mlxq" else "batch_generator"
            return run_mlxq(model, tokenizer, name, wl, size.profile, url, cache_bytes, engine)

        if args.warm_modes:
            warm_modes(workloads, variants, run_one)
        runs = run_rounds(workloads, variants, args.repeat, run_one, sweep, sizes)
        for wl in workloads:
            results = [median_run(runs[(wl.name, v)]) for v in variants[wl.name]]
            batches = ", ".join(
                f"{s.batch} ({s.source}; prefill batch {prefill_for(wl, s)})" for s in sizes
            )
            header = (
                f"{model_line(info)} on {device} | workload {wl.label} | mlxq batch{'es' * sweep} "
                f"{batches} | batch_generate: mlx-lm defaults "
                f"(batch {bg[0]}, prefill batch {bg[1]})"
            )
            if args.repeat > 1:
                header += f" | median of {args.repeat} runs"
            print()
            print(report(header, results, wl))
            if sweep:
                print(sweep_report(results, wl))
            sys.stdout.flush()
            out["workloads"].append(workload_json(wl, results))
        if twins := twin_ratios(out["workloads"], sizes[0].batch):
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


def warm_modes(workloads: list[Workload], variants: dict[str, list[Variant]], run_one: Any) -> None:
    """Each mode (at each batch size) once, untimed, on a short copy of every workload (its
    prompts, 8 tokens each): a GPU compiles kernels for the first steps of each new shape,
    and whichever run came first would pay for them inside its timing."""
    clock = Stopwatch()
    for wl in workloads:
        short = dataclasses.replace(wl, max_tokens=[min(8, m) for m in wl.max_tokens])
        for v in variants[wl.name]:
            if v.mode != "naive":
                run_one(short, v)
    fresh_memory()
    print(f"modes warmed up in {clock.stop():.1f} s", file=sys.stderr)


def run_rounds(
    workloads: list[Workload],
    variants: dict[str, list[Variant]],
    repeat: int,
    run_one: Any,
    sweep: bool,
    sizes: list[Sizing],
) -> dict[tuple[str, Variant], list[ModeResult]]:
    """Every (workload, variant) ``repeat`` times, keyed so. Repeats go round every
    workload, mode and batch size in turn, so a change in the load of a shared machine hits
    them alike."""
    runs: dict[tuple[str, Variant], list[ModeResult]] = {}
    for i in range(repeat):
        for wl in workloads:
            for v in variants[wl.name]:
                fresh_memory()
                print(f"{wl.name}: {v.label(sweep, sizes)} ({i + 1}/{repeat}) ...", file=sys.stderr)
                runs.setdefault((wl.name, v), []).append(run_one(wl, v))
    return runs


def export_jsonl(workloads: list[Workload], folder: Path) -> None:
    """Write each workload's requests as FOLDER/NAME.jsonl, for `mlxq run`."""
    folder.mkdir(parents=True, exist_ok=True)
    for wl in workloads:
        lines = (json.dumps(row) for row in wl.jsonl())
        (folder / f"{wl.name}.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(workloads)} workloads to {folder}/", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
