"""The cost of structured outputs: JSON-schema jobs next to the same jobs unconstrained.

One in-memory engine per mode on the same random-weight model (no Redis: the cost of
constraints is an engine matter). Per batch size, ``--factor`` x batch jobs (a queue deeper
than the batch) with prompts of mixed lengths run three ways:

- ``json``: every job has a bounded JSON schema (``response_format``); each ends when its
  schema completes (varied lengths, as EOS would make them);
- ``free``: the same prompts without constraints, EOS off, each generating exactly as many
  tokens as it did under its schema (the same work, so the ratio is the constraints' cost);
- ``mixed``: every other job constrained, the rest free (as ``free``).

Tok/s counts every decode step of a job (its EOS step too). Modes alternate for
``--repeat`` rounds and the median is reported. On a shared machine one run of the same
jobs can be 15% faster than the next, so ``json`` and ``free`` also run interleaved:
both engines hold their jobs and take turns of ``--interleave`` decode steps, each timed
(device work included) on its own; both see the same moments of the machine.

Usage: ``python bench/constraints.py --preset tiny --batches 64,256`` (see bench/README.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

from common import (
    Stopwatch,
    describe_device,
    fmt_num,
    preset_tokenizer,
    set_up_like_mlxq,
    table,
    write_json,
)

SEED = 0
PROMPT_RANGE = (16, 512)
# A JSON step's parts reported (ms a step), by the EngineStats field each comes from.
STEP_PARTS = {
    "decode": "decode_seconds",
    "mask_helper": "mask_seconds",
    "mask_wait": "mask_wait_seconds",
    "token_wait": "token_wait_seconds",
    "sample_launch": "sample_launch_seconds",
}
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
        "topics": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "spam": {"type": "boolean"},
    },
    "required": ["title", "sentiment", "score", "topics", "spam"],
    "additionalProperties": False,
}


def load(preset: str, path: str | None = None) -> tuple[Any, Any]:
    """The model at ``path`` (loaded by mlx-lm) or, without one, the preset with random
    weights built in memory (an 8B shape writes no 16 GB to disk) and its tokenizer."""
    if path:
        import mlx_lm

        return mlx_lm.load(path)[:2]
    from mlxq.engine.models.make import build_model

    return build_model(preset, seed=SEED)[0], preset_tokenizer()


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` prompts of token ids, log-uniform lengths in PROMPT_RANGE, no special tokens."""
    rng = random.Random(SEED)
    special = set(tokenizer.all_special_ids) | set(tokenizer.eos_token_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    lo, hi = PROMPT_RANGE
    lengths = [round(lo * (hi / lo) ** rng.random()) for _ in range(n)]
    return [[rng.choice(pool) for _ in range(k)] for k in lengths]


def run(engine: Any, jobs: list[Any]) -> tuple[tuple[float, float], dict[str, Any]]:
    """Admit every job, step until all are done: (wall, CPU) seconds and the completions.

    CPU seconds (all of the process's threads) are the steadier figure on a shared machine.
    """
    return timed_run(engine, jobs)[:2]


def admit(engine: Any, jobs: list[Any]) -> None:
    """Add the requests ``jobs`` to ``engine`` as jobs "0", "1", ..."""
    from mlxq.engine.sampling import EngineJob

    for i, request in enumerate(jobs):
        assert engine.add(EngineJob(str(i), request)) is None


def timed_run(engine: Any, jobs: list[Any]) -> tuple[tuple[float, float], dict[str, Any], Any]:
    """:func:`run`, and the engine's counts of the run (``EngineStats``)."""
    before = engine.stats()
    clock, cpu = Stopwatch(), time.process_time()
    admit(engine, jobs)
    done = {}
    while engine.active:
        done.update((c.key, c) for c in engine.step())
    return (clock.stop(), time.process_time() - cpu), done, engine.stats().since(before)


def interleaved(runs: list[tuple[Any, list[Any]]], turn: int) -> list[tuple[float, int]]:
    """Seconds and tokens (:func:`steps`) of each engine's jobs, the engines taking turns
    of ``turn`` engine steps until all are done; a turn ends once the device has
    finished its work.

    (A constrained engine's helper thread may fill the next masks during the other's
    turn: at most one helper run per turn in its favour, a few percent at 32 steps.)
    """
    import mlx.core as mx

    for engine, jobs in runs:
        admit(engine, jobs)
    seconds, tokens = [0.0] * len(runs), [0] * len(runs)
    while any(engine.active for engine, _ in runs):
        for k, (engine, _) in enumerate(runs):
            tic = time.perf_counter()
            for _ in range(turn):
                if not engine.active:
                    break
                tokens[k] += sum(steps(c) for c in engine.step())
            mx.synchronize()
            seconds[k] += time.perf_counter() - tic
    return list(zip(seconds, tokens, strict=True))


def steps(c: Any) -> int:
    """Decode steps a job took: its tokens, plus the EOS step that ended it."""
    return len(c.token_ids) + (c.finish_reason == "stop")


def bench_batch(model: Any, tokenizer: Any, batch: int, args: argparse.Namespace) -> dict:
    from mlxq.engine.factory import make_engine
    from mlxq.wire import JsonSchemaFormat, JsonSchemaSpec, Request

    fmt = JsonSchemaFormat(JsonSchemaSpec(schema=SCHEMA, name="review", strict=True))
    ps = prompts(tokenizer, batch * args.factor)
    sizes = {"max_batch": batch, "prefill_batch": args.prefill_batch}
    constrained = make_engine(model, tokenizer, "bench", **sizes)
    json_jobs = [Request(prompt=p, max_tokens=args.max_tokens, response_format=fmt) for p in ps]
    run(constrained, json_jobs[:4])  # warm up: compile the schema, build the tokenizer
    _, first = run(constrained, json_jobs)
    lengths = [steps(first[str(i)]) for i in range(len(ps))]
    unfinished = sum(c.finish_reason != "stop" for c in first.values())

    eos, tokenizer.eos_token_ids = tokenizer.eos_token_ids, []  # free jobs: exact lengths
    try:
        free = make_engine(model, tokenizer, "bench", **sizes)
    finally:
        tokenizer.eos_token_ids = eos
    free_jobs = [Request(prompt=p, max_tokens=n) for p, n in zip(ps, lengths, strict=True)]
    mixed_jobs = [json_jobs[i] if i % 2 == 0 else free_jobs[i] for i in range(len(ps))]
    run(free, free_jobs[:4])

    secs: dict[str, list[tuple[float, float]]] = {"free": [], "json": [], "mixed": []}
    parts: list[tuple[float, ...]] = []  # json: ms a step of each of STEP_PARTS
    for _ in range(args.repeat):
        secs["free"].append(run(free, free_jobs)[0])
        wall, _, work = timed_run(constrained, json_jobs)
        secs["json"].append(wall)
        per_step = 1000 / max(1, work.decode_steps)
        parts.append(tuple(getattr(work, f) * per_step for f in STEP_PARTS.values()))
        secs["mixed"].append(run(constrained, mixed_jobs)[0])
    tokens = sum(lengths)
    side = interleaved([(free, free_jobs), (constrained, json_jobs)], args.interleave)
    out = {"batch": batch, "jobs": len(ps), "tokens": tokens, "unfinished_json": unfinished}
    out["json_step_ms"] = {
        name: statistics.median(p[i] for p in parts) for i, name in enumerate(STEP_PARTS)
    }
    (free_s, free_tokens), (json_s, json_tokens) = side
    out["interleaved"] = {
        "free_s": free_s,
        "json_s": json_s,
        "json_per_free": (json_tokens / json_s) / (free_tokens / free_s),
    }
    out["mean_output"] = tokens / len(ps)
    out["mean_prompt"] = sum(map(len, ps)) / len(ps)
    for mode, s in secs.items():
        wall, cpu = [w for w, _ in s], [c for _, c in s]
        out[mode] = {"wall_s": wall, "cpu_s": cpu, "tok_s": tokens / statistics.median(wall)}
        out[mode]["tok_per_cpu_s"] = tokens / statistics.median(cpu)
    return out


def report(rows: list[dict], header: str) -> str:
    lines = [header, ""]
    cells = []
    for r in rows:
        free, json_, mixed = r["free"], r["json"], r["mixed"]
        cells.append(
            [
                str(r["batch"]),
                f"{r['jobs']} ({r['mean_prompt']:.0f} + {r['mean_output']:.0f})",
                fmt_num(free["tok_s"]),
                fmt_num(json_["tok_s"]),
                f"{json_['tok_s'] / free['tok_s']:.2f}x",
                f"{r['interleaved']['json_per_free']:.2f}x",
                f"{json_['tok_per_cpu_s'] / free['tok_per_cpu_s']:.2f}x",
                f"{mixed['tok_s'] / free['tok_s']:.2f}x",
                f"{mixed['tok_per_cpu_s'] / free['tok_per_cpu_s']:.2f}x",
                str(r["unfinished_json"]),
            ]
        )
    headers = ["batch", "jobs (prompt + out)", "free tok/s", "json tok/s", "json/free"]
    headers += ["(interleaved)", "(CPU)", "mixed/free", "(CPU)", "json unfinished"]
    lines.append(table(headers, cells))
    lines += ["", "JSON decode steps, ms a step (medians): the whole step; the mask helper's"]
    lines += ["work (another thread, beside it); the step waiting for the helper; waiting for"]
    lines += ["the last step's tokens; the sampling launch after the model's (with the wait)"]
    cells = [[str(r["batch"]), *(f"{r['json_step_ms'][k]:.2f}" for k in STEP_PARTS)] for r in rows]
    headers = ["batch", "decode step", "mask helper", "waiting for it", "for tokens", "sampling"]
    lines.append(table(headers, cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="mlxq.engine.models.make preset")
    p.add_argument("--model", help="a local mlx-lm model folder instead of a preset")
    p.add_argument("--batches", default="64,256", help="decode batch sizes, comma-separated")
    p.add_argument("--factor", type=int, default=2, help="jobs per run = factor x batch")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of the JSON jobs")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3, help="rounds of the three modes")
    p.add_argument(
        "--interleave",
        type=int,
        default=32,
        help="decode steps per turn when free and JSON jobs run interleaved",
    )
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args(argv)
    if args.interleave < 1:
        p.error(f"--interleave {args.interleave}: give at least 1 step per turn")
    return args


def main(argv: list[str] | None = None) -> int:
    from mlxq.engine.gil import shorten_switch_interval

    set_up_like_mlxq()
    shorten_switch_interval()  # as the worker's MLX thread does (no Runner here)
    args = parse_args(argv)
    model, tokenizer = load(args.preset, args.model)
    rows = [bench_batch(model, tokenizer, int(b), args) for b in args.batches.split(",")]
    name = args.model or args.preset
    header = f"{name} on {describe_device()}, prefill batch {args.prefill_batch}"
    print(report(rows, header))
    if args.json:
        write_json(args.json, {"model": name, "device": describe_device(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
