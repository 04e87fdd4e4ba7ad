"""Tokens/s of one worker's engine split over 1, 2 and 3 ranks on this machine (MLX's
ring backend over localhost), by heads and by layers, and the bytes the ranks send each
other per decode step.

    python bench/distributed.py [--preset cpu-small-tp] [--jobs 48] [--batch 16]
        [--sizes 1,2,3] [--splits tensor,pipeline] [--device cpu]

The same workload for every run (prompts of 32-128 tokens, 16-128 output tokens, varied;
a queue 3x the batch), through the slot engine. Tensor parallel: the lockstep engine;
bytes are its broadcasts (counted by the channel) and the model's ``all_sum`` calls (two
per layer: rows x hidden x dtype bytes each), as each rank sends them over a ring:
2 (N-1)/N times an all_sum's bytes. Pipeline parallel: one engine per micro-batch on
every rank; bytes are rank 0's messages and tokens to each rank (the relay) and the
activations each stage sends the next (counted as rank 0 receives them: one link's).
Counts are of the steps of rank 0's engines (a pipeline's turns step one micro-batch).
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


def count_sends(name: str) -> dict[str, int]:
    """Count the calls and bytes of ``mx.distributed.<name>`` (all_sum, recv) from now on."""
    import mlx.core as mx

    counts = {"calls": 0, "bytes": 0}
    original = getattr(mx.distributed, name)

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        counts["calls"] += 1
        counts["bytes"] += out.nbytes
        return out

    setattr(mx.distributed, name, counted)
    return counts


def rank_main(model_dir: str, jobs: int, batch: int, split: str, out: str, device: str) -> None:
    """One run (or one rank of it): time the workload, write figures (rank 0)."""
    import mlx.core as mx

    from mlxq.engine.slots.engine import SlotEngine

    if device == "cpu":  # (on a GPU host: the ranks compute on its CPU cores)
        mx.set_default_device(mx.cpu)

    if "MLX_RANK" not in os.environ:
        import mlx_lm

        model, tokenizer = mlx_lm.load(model_dir)
        engine = SlotEngine(model, tokenizer, "m", max_batch=batch)
        engine.warmup()
        Path(out).write_text(json.dumps({"ranks": 1, "split": "-", **timed(engine, jobs, batch)}))
        return
    from mlxq.engine.distributed import pipeline
    from mlxq.engine.distributed.channel import Channel
    from mlxq.engine.distributed.lockstep import LockstepEngine, follow
    from mlxq.engine.distributed.relay import Relay
    from mlxq.engine.distributed.split import load_split
    from mlxq.engine.distributed.start import greet, join

    channel = Channel(join("ring"))
    greet(channel, model_dir, Path(model_dir))
    size, group = channel.size, channel.group
    model, tokenizer, _, _ = load_split(model_dir, Path(model_dir), None, group, split)
    figures: dict = {"ranks": size, "split": split}
    if split == "tensor":
        engine = SlotEngine(model, tokenizer, "m", max_batch=batch)
        if channel.rank:
            follow(engine, channel)
            return
        lockstep = LockstepEngine(engine, channel)
        lockstep.warmup()
        sums, traffic = count_sends("all_sum"), channel.traffic
        before = traffic.array_bytes
        figures.update(timed(lockstep, jobs, batch))
        figures["control_bytes"] = traffic.array_bytes - before
        figures["model_bytes"], figures["ring_factor"] = sums["bytes"], 2 * (size - 1) / size
        lockstep.close()
    else:
        engines = [
            SlotEngine(model, tokenizer, "m", max_batch=-(-batch // size)) for _ in range(size)
        ]
        for e in engines:
            e.as_stage(samples=channel.rank == 0)
        relay = Relay(group)
        if channel.rank:
            pipeline.follow(engines, relay)
            return
        engine = pipeline.PipelineEngine(engines, relay)
        engine.warmup()
        recvs, before = count_sends("recv"), relay.traffic.array_bytes
        figures.update(timed(engine, jobs, batch))
        figures["steps"] = sum(e.stats().decode_steps for e in engines) - figures["warm_steps"]
        figures["control_bytes"] = relay.traffic.array_bytes - before
        figures["model_bytes"], figures["ring_factor"] = recvs["bytes"], 1.0
        engine.close()
    Path(out).write_text(json.dumps(figures))


def timed(engine, jobs: int, batch: int) -> dict:
    """Run the workload (a queue 3x the batch, topped up as jobs finish); its figures."""
    from mlxq.engine.sampling import EngineJob
    from mlxq.wire import Request

    pending = [
        EngineJob(f"j{i}", Request(prompt=p, max_tokens=m))
        for i, (p, m) in enumerate(workload(jobs))
    ]
    warm = engine.stats().decode_steps
    tokens, tic = 0, time.perf_counter()
    while pending or engine.active:
        while pending and engine.active < batch:
            engine.add(pending.pop(0))
        tokens += sum(c.completion_tokens for c in engine.step())
    seconds = time.perf_counter() - tic
    steps = engine.stats().decode_steps - warm
    return {"tokens": tokens, "steps": steps, "seconds": seconds, "warm_steps": warm}


def run(model_dir: str, ranks: int, split: str, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"r{ranks}-{split}.json"
    cmd = [sys.executable, __file__, "--rank", model_dir, "--jobs", str(args.jobs)]
    cmd += ["--batch", str(args.batch), "--split", split, "--out", str(out)]
    cmd += ["--device", args.device]
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
    parser.add_argument("--splits", default="tensor,pipeline")
    parser.add_argument("--device", choices=["default", "cpu"], default="default")
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # (a run: the model folder)
    parser.add_argument("--split", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank, args.jobs, args.batch, args.split, args.out, args.device)
        return
    from mlxq.engine.models.make import make_model, preset_config

    config = preset_config(args.preset)
    runs = [
        (int(n), split)
        for n in args.sizes.split(",")
        for split in (["-"] if n == "1" else args.splits.split(","))
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model(Path(tmp) / args.preset, args.preset))
        rows = [run(model_dir, n, split, args, Path(tmp)) for n, split in runs]
    print(f"model {args.preset}: {json.dumps(config)}; {args.jobs} jobs, batch {args.batch}")
    print(
        "| ranks | split | gen tok/s | steps | model bytes/step | control bytes/step "
        "| sent per rank per token |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    base = next((r["tokens"] / r["seconds"] for r in rows if r["ranks"] == 1), None)
    for r in rows:
        rate = r["tokens"] / r["seconds"]
        ratio = f" ({rate / base:.2f}x)" if base else ""
        if r["ranks"] == 1:
            print(f"| 1 | - | {rate:,.0f}{ratio} | {r['steps']} | - | - | - |")
            continue
        steps = r["steps"]
        per_token = r["ring_factor"] * (r["model_bytes"] + r["control_bytes"]) / r["tokens"]
        print(
            f"| {r['ranks']} | {r['split']} | {rate:,.0f}{ratio} | {steps} "
            f"| {r['model_bytes'] / steps:,.0f} | {r['control_bytes'] / steps:,.0f} "
            f"| {per_token:,.0f} B |"
        )


if __name__ == "__main__":
    main()
