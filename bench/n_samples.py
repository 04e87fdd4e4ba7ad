"""``n`` samples per request against the same samples as separate submissions.

One in-memory slot engine per mode on the same random-weight model (no Redis: the saving
is an engine matter), admitting jobs as the worker's scheduler does (a row per sample, up
to ``--batch`` rows; a job's rows all at once). ``--prompts`` prompts, each sampled
``--n`` times at temperature 1:

- ``n``: one job per prompt with ``n`` samples (its prompt prefilled once, its KV written
  into n slots);
- ``separate``: the prompts submitted ``n`` times over, job ``i`` of round ``k`` seeded
  ``seed + k`` (the same samples as ``n`` gives), in submission order;
- ``separate+prefix``: the same, with the worker's shared-prefix cache (``--prefix-mib``),
  which can find the repeats' prompts stored: the best a worker does without ``n`` today.

Two workloads: ``prefill`` (prompts of ``--prompt-tokens``, ``--prefill-out`` tokens out)
and ``decode`` (``--short-prompt`` tokens in, ``--decode-out`` out), EOS off so every
sample generates all its tokens. Modes alternate for ``--repeat`` rounds; the median wall
and CPU seconds are reported (CPU seconds are the steadier figure on a shared machine).

Usage: ``python bench/n_samples.py --preset cpu-small`` (see bench/README.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import deque
from typing import Any

import common

SEED = 0
MODES = ("n", "separate", "separate+prefix")


def prompts(tokenizer: Any, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of random ordinary token ids, 0.75..1.25x ``tokens`` long."""
    rng = random.Random(SEED)
    special = set(tokenizer.all_special_ids) | set(tokenizer.eos_token_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    lengths = [max(2, round(tokens * rng.uniform(0.75, 1.25))) for _ in range(count)]
    return [[rng.choice(pool) for _ in range(k)] for k in lengths]


def jobs(mode: str, ps: list[list[int]], n: int, out: int) -> list[Any]:
    """The requests of ``mode``: one of n samples per prompt, or n rounds of every prompt."""
    from mlxq.wire import Request

    def request(p: list[int], seed: int, samples: int) -> Request:
        return Request(prompt=p, max_tokens=out, temperature=1.0, seed=seed, n=samples)

    if mode == "n":
        return [request(p, 1000 * i, n) for i, p in enumerate(ps)]
    return [request(p, 1000 * i + k, 1) for k in range(n) for i, p in enumerate(ps)]


def run(engine: Any, requests: list[Any], batch: int) -> tuple[float, float, dict[str, Any]]:
    """Admit the jobs as rows free up (a job's samples at once), step until all are done:
    (wall, CPU) seconds and the completions by key."""
    from mlxq.engine.sampling import EngineJob

    pending = deque(EngineJob(str(i), r) for i, r in enumerate(requests))
    done: dict[str, Any] = {}
    rows: dict[str, int] = {}
    clock, cpu = common.Stopwatch(), time.process_time()
    while pending or rows:
        while pending and (not rows or sum(rows.values()) + pending[0].request.n <= batch):
            job = pending.popleft()
            assert engine.add(job) is None
            rows[job.key] = job.request.n
        for c in engine.step():
            done[c.key] = c
            del rows[c.key]
    return clock.stop(), time.process_time() - cpu, done


def samples(mode: str, done: dict[str, Any], count: int, n: int) -> list[list[list[int]]]:
    """Each prompt's samples' tokens, in seed order, whichever way they were asked for."""
    if mode == "n":
        return [[c.token_ids for c in done[str(i)].choices] for i in range(count)]
    return [[done[str(k * count + i)].token_ids for k in range(n)] for i in range(count)]


def bench_case(model: Any, tokenizer: Any, name: str, args: argparse.Namespace) -> dict:
    from mlxq.engine.factory import make_engine
    from mlxq.engine.scheduler import PREFILL_TOKENS

    short = name == "decode"
    ps = prompts(tokenizer, args.prompts, args.short_prompt if short else args.prompt_tokens)
    out = args.decode_out if short else args.prefill_out
    options = {"max_batch": args.batch, "prefill_tokens": PREFILL_TOKENS["cpu"]}
    eos, tokenizer.eos_token_ids = tokenizer.eos_token_ids, []  # exact lengths
    try:
        engines = {
            mode: make_engine(
                model,
                tokenizer,
                "bench",
                prefix_cache_bytes=args.prefix_mib << 20 if mode.endswith("prefix") else 0,
                **options,
            )
            for mode in MODES
        }
    finally:
        tokenizer.eos_token_ids = eos
    work = {mode: jobs(mode, ps, args.n, out) for mode in MODES}
    for mode, engine in engines.items():  # warm up: compile and allocate
        run(engine, work[mode][:2], args.batch)
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    outputs = {}
    for _ in range(args.repeat):
        for mode, engine in engines.items():
            before = engine.stats()
            w, c, done = run(engine, work[mode], args.batch)
            wall[mode].append(w)
            cpu[mode].append(c)
            outputs[mode] = samples(mode, done, len(ps), args.n)
            stats = engine.stats().since(before)
            print(
                f"  {name} {mode}: {w:.2f} s wall, {c:.2f} s CPU, prefilled "
                f"{stats.prefilled_tokens:,} tokens in {stats.prefill_seconds:.2f} s, "
                f"{stats.decode_steps:,} decode steps in {stats.decode_seconds:.2f} s",
                file=sys.stderr,
            )
    same = outputs["n"] == outputs["separate"]
    result = {"case": name, "prompts": len(ps), "n": args.n, "max_tokens": out, "same": same}
    result["mean_prompt"] = sum(map(len, ps)) / len(ps)
    for mode in MODES:
        result[mode] = {
            "wall_s": wall[mode],
            "cpu_s": cpu[mode],
            "median_wall_s": statistics.median(wall[mode]),
            "median_cpu_s": statistics.median(cpu[mode]),
        }
    return result


def report(results: list[dict], args: argparse.Namespace) -> str:
    headers = ["case", "prompt", "out", *(f"{m} s" for m in MODES), "n / separate"]
    headers += ["n / +prefix", "CPU n / separate", "same samples"]
    rows = []
    for r in results:
        wall = [r[m]["median_wall_s"] for m in MODES]
        cpu = [r[m]["median_cpu_s"] for m in MODES]
        rows.append(
            [
                r["case"],
                common.fmt_num(r["mean_prompt"], 0),
                str(r["max_tokens"]),
                *(common.fmt_num(w, 2) for w in wall),
                f"{wall[0] / wall[1]:.2f}x",
                f"{wall[0] / wall[2]:.2f}x",
                f"{cpu[0] / cpu[1]:.2f}x",
                "yes" if r["same"] else "no",
            ]
        )
    head = (
        f"{args.prompts} prompts x n={args.n}, batch {args.batch} rows, preset {args.preset}, "
        f"median of {args.repeat}; {common.describe_device()}"
    )
    return head + "\n" + common.table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="cpu-small", help="mlxq make-model preset")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="rows (samples) decoding at once")
    p.add_argument("--prompt-tokens", type=int, default=384, help="prefill case: prompt length")
    p.add_argument("--prefill-out", type=int, default=8, help="prefill case: tokens out")
    p.add_argument("--short-prompt", type=int, default=32, help="decode case: prompt length")
    p.add_argument("--decode-out", type=int, default=64, help="decode case: tokens out")
    p.add_argument("--prefix-mib", type=int, default=256, help="separate+prefix: cache MiB")
    p.add_argument("--cases", default="prefill,decode")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    common.set_up_like_mlxq()
    from mlxq.engine.models.make import build_model

    model = build_model(args.preset, seed=SEED)[0]
    tokenizer = common.preset_tokenizer()
    results = [bench_case(model, tokenizer, c, args) for c in args.cases.split(",")]
    print(report(results, args))
    if args.json:
        common.write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
