"""Tokens/s of one worker's engine split over 1, 2 and 3 ranks on this machine (MLX's
ring backend over localhost), and the bytes the ranks send each other per decode step.

    python bench/distributed.py [--preset cpu-small-tp] [--jobs 48] [--batch 16]

The same workload for every size (prompts of 32-128 tokens, 16-128 output tokens, varied,
EOS ignored by the random model only by chance: counts are of tokens generated), through
the slot engine; ranks > 1 run the tensor-parallel lockstep engine. Bytes: the lockstep
broadcasts (counted by the channel) and the model's ``all_sum`` calls (two per layer:
rows x hidden x dtype bytes each), as each rank sends them over a ring: 2 (N-1)/N times
an all_sum's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def workload(n: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt, max_tokens): varied lengths, the same for every run."""
    return [(list(range(10, 10 + 32 + (37 * i) % 97)), 16 + (53 * i) % 113) for i in range(n)]


def count_model_sums() -> dict[str, int]:
    """Count the bytes of every model all_sum (shard_linear's calls go through here)."""
    import mlx.core as mx

    counts = {"calls": 0, "bytes": 0}
    original = mx.distributed.all_sum

    def counted(x, *args, **kwargs):
        counts["calls"] += 1
        counts["bytes"] += x.nbytes
        return original(x, *args, **kwargs)

    mx.distributed.all_sum = counted
    return counts


def rank_main(model_dir: str, jobs: int, batch: int, out: str) -> None:
    """One run (or one rank of it): time the workload, write figures (rank 0)."""
    import mlx_lm

    from mlxq.engine.sampling import EngineJob
    from mlxq.engine.slots.engine import SlotEngine
    from mlxq.wire import Request

    size, channel, sums = 1, None, {"calls": 0, "bytes": 0}
    if "MLX_RANK" in os.environ:
        from mlxq.engine.distributed.channel import Channel
        from mlxq.engine.distributed.lockstep import LockstepEngine, follow
        from mlxq.engine.distributed.start import greet, join
        from mlxq.engine.distributed.tensor import load_sharded

        channel = Channel(join("ring"))
        greet(channel, model_dir, Path(model_dir))
        size = channel.size
        model, tokenizer = load_sharded(model_dir, Path(model_dir), None, channel.group)
        engine = SlotEngine(model, tokenizer, "m", max_batch=batch)
        if channel.rank:
            follow(engine, channel)
            return
        engine = LockstepEngine(engine, channel)
    else:
        model, tokenizer = mlx_lm.load(model_dir)
        engine = SlotEngine(model, tokenizer, "m", max_batch=batch)
    engine.warmup()
    if channel is not None:
        sums = count_model_sums()
        before = (channel.traffic.collectives, channel.traffic.array_bytes)
    pending = [
        EngineJob(f"j{i}", Request(prompt=p, max_tokens=m))
        for i, (p, m) in enumerate(workload(jobs))
    ]
    tokens, steps, tic = 0, 0, time.perf_counter()
    while pending or engine.active:
        while pending and engine.active < batch:
            engine.add(pending.pop(0))
        tokens += sum(c.completion_tokens for c in engine.step())
        steps += 1
    seconds = time.perf_counter() - tic
    figures = {"ranks": size, "tokens": tokens, "steps": steps, "seconds": seconds}
    if channel is not None:
        figures["lockstep_collectives"] = channel.traffic.collectives - before[0]
        figures["lockstep_bytes"] = channel.traffic.array_bytes - before[1]
        figures["model_sums"], figures["model_sum_bytes"] = sums["calls"], sums["bytes"]
        engine.close()
    Path(out).write_text(json.dumps(figures))


def run(model_dir: str, ranks: int, jobs: int, batch: int, tmp: Path) -> dict:
    out = tmp / f"r{ranks}.json"
    cmd = [sys.executable, __file__, "--rank", model_dir, "--jobs", str(jobs)]
    cmd += ["--batch", str(batch), "--out", str(out)]
    if ranks == 1:
        subprocess.run(cmd, check=True)
    else:
        from tests.helpers import free_port

        hosts = tmp / f"hosts{ranks}.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
        procs = [
            subprocess.Popen(
                cmd, env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)}
            )
            for r in range(ranks)
        ]
        assert [p.wait() for p in procs] == [0] * ranks
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-small-tp")
    parser.add_argument("--jobs", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--sizes", default="1,2,3")
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # (a run: the model folder)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank, args.jobs, args.batch, args.out)
        return
    from mlxq.engine.models.make import make_model, preset_config

    config = preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(Path(tmp) / args.preset, args.preset))
        rows = [
            run(model_dir, int(n), args.jobs, args.batch, Path(tmp)) for n in args.sizes.split(",")
        ]
    print(f"model {args.preset}: {json.dumps(config)}; {args.jobs} jobs, batch {args.batch}")
    print(
        "| ranks | gen tok/s | steps | model all_sum bytes/step | lockstep bytes/step "
        "| sent per rank per token |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    base = rows[0]["tokens"] / rows[0]["seconds"]
    for r in rows:
        rate = r["tokens"] / r["seconds"]
        if r["ranks"] == 1:
            print(f"| 1 | {rate:,.0f} (1.00x) | {r['steps']} | - | - | - |")
            continue
        n, steps = r["ranks"], r["steps"]
        ring = 2 * (n - 1) / n
        model_step = r["model_sum_bytes"] / steps
        lock_step = r["lockstep_bytes"] / steps
        per_token = ring * (r["model_sum_bytes"] + r["lockstep_bytes"]) / r["tokens"]
        print(
            f"| {n} | {rate:,.0f} ({rate / base:.2f}x) | {steps} | {model_step:,.0f} "
            f"| {lock_step:,.0f} | {per_token:,.0f} B |"
        )


if __name__ == "__main__":
    main()
