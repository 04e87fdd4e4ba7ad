"""Soak: thousands of jobs through one long-lived worker; does its memory stay flat?

Submits all jobs, runs them through one in-process ``MlxqWorker`` (embedded Valkey, a
real model) and samples, every jobs/batches finished jobs, the process's resident memory
and MLX's active and peak memory. A leak shows as a steady climb; flat is good.

    python bench/soak.py --preset tiny --jobs 3000 --batches 6
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxq.engine.blas import reexec_with_openblas

reexec_with_openblas()

import mlx.core as mx  # noqa: E402

from mlxq.broker import batches  # noqa: E402
from mlxq.engine.models.make import make_model  # noqa: E402
from mlxq.server import embedded  # noqa: E402
from mlxq.wire import Request  # noqa: E402
from mlxq.worker.launch import run_worker  # noqa: E402
from mlxq.worker.profile import WorkerProfile  # noqa: E402


def rss_mib() -> float:
    """Current resident set size of this process, MiB (Linux /proc; else peak RSS)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def requests(n: int, offset: int, max_tokens: int, sentences: int = 8) -> list[Request]:
    """Varied work: prompts of 1 to ``sentences`` sentences (~8 tokens each), outputs of 1 to
    ``max_tokens`` tokens
    (as EOS would cut them), a third sampled."""
    rng = random.Random(offset)
    out = []
    for i in range(n):
        count = rng.randint(1, sentences)
        prompt = " ".join(f"Item {i % 97} sentence {k} of a story." for k in range(count))
        out.append(
            Request(
                prompt=f"Request {offset + i}: {prompt}",
                max_tokens=max(1, min(max_tokens, int(rng.expovariate(3 / max_tokens)) + 1)),
                temperature=0.7 if i % 3 else 0.0,
                seed=i,
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model", help="a model folder instead of a preset")
    ap.add_argument("--jobs", type=int, default=3000, help="total jobs")
    ap.add_argument("--batches", type=int, default=6, help="measure after each of these")
    ap.add_argument("--max-tokens", type=int, default=32, help="longest output (mean ~1/3)")
    ap.add_argument("--sentences", type=int, default=8, help="longest prompt, in sentences")
    ap.add_argument("--max-batch", type=int, default=32)
    args = ap.parse_args()
    model = args.model or str(make_model(Path("/tmp/mlxq-soak") / args.preset, args.preset))
    every = args.jobs // args.batches
    rows: list[tuple[int, float, float, float, float]] = []
    with embedded() as url:
        conn = batches.connect(url)
        info = batches.submit(
            conn, requests(args.jobs, 0, args.max_tokens, args.sentences), queue="soak"
        )
        profile = WorkerProfile(model=model, max_batch=args.max_batch, name="soak")
        start, done = time.monotonic(), [0]

        def sample(_result: object) -> None:
            # Read on the worker's main thread: counters only, no MLX computation.
            done[0] += 1
            if done[0] % every == 0:
                row = (
                    done[0],
                    rss_mib(),
                    mx.get_active_memory() / 2**20,
                    mx.get_peak_memory() / 2**20,
                    time.monotonic() - start,
                )
                rows.append(row)
                # As it goes too, so a soak cut short still leaves its samples.
                print("sample", *(f"{v:.1f}" for v in row), file=sys.stderr, flush=True)

        run_worker(
            profile, conn, burst=True, queues=["soak"], on_finish=sample, log_level="WARNING"
        )
        s = batches.batch_status(conn, info.batch_id)
        assert s.finished == args.jobs, s
    print(
        f"soak: {args.jobs} jobs of 1-{args.max_tokens} tokens through one worker, model "
        f"{args.model or args.preset}, batch {args.max_batch}"
    )
    print(f"{'jobs':>6} {'RSS MiB':>9} {'MLX active MiB':>15} {'MLX peak MiB':>13} {'s':>7}")
    for jobs, rss, active, peak, secs in rows:
        print(f"{jobs:>6} {rss:>9.1f} {active:>15.1f} {peak:>13.1f} {secs:>7.1f}")
    if len(rows) > 2:
        print(f"RSS change from sample 2 to the last: {rows[-1][1] - rows[1][1]:+.1f} MiB")


if __name__ == "__main__":
    main()
