"""Host time of the slot engine's decode step, per step and per row, at given batch sizes.

On CUDA a decode step is host-bound: the next step is built and launched while the last
one computes, so the Python the engine runs per step (bookkeeping of every row, inputs,
launch) is the step's time. This script measures that host time on the CPU with the
random ``tiny`` model: the main thread's CPU time (``time.thread_time``) per
``engine.step()``, which leaves out the waits for MLX's compute (it runs on MLX's own
threads), so the figure is the Python and launch work alone.

For each ``--rows`` size it runs ``--jobs-per-row`` times as many jobs as rows (prompts
of 16-128 random tokens, ``max_tokens`` 16-256, greedy), so rows finish at different
steps and waiting jobs join; as a worker does, it keeps about an eighth of the batch
waiting, not every job at once. It reports the median host ms of the steps at a full
batch (at least 90% of the rows decoding), that over the rows (µs per row), the median
wall ms of those steps where nothing joined (the steady step, host and device: on CUDA
the device's time where the host keeps ahead), and the mean host ms over all steps; a
joining group's prefill is left out (its cost grows with the group, not with the rows
decoding); and the engine's copies of its slot cache (their count and seconds: each a
new layout as rows join and leave) and its compiled forward's traces (one per new cache
shape). ``--mix F`` gives a fraction F of the jobs stop strings, F
streaming, F logprobs; ``--profile N`` prints cProfile's top N functions (by their own
time) of the largest size's run.

``MLXQ_SLOT_OVERLAP=1`` (and ``MLXQ_SLOT_COMPILE=1``) build each step as on CUDA; the CPU
default waits for each step before the next (``--cuda-like`` sets both).

``--preset NAME`` runs a random-weight preset (``llama-3.2-1b`` on a GPU) instead of
``tiny``, in the weight format the worker would pick; ``--uniform P,O`` gives every job
a prompt of P tokens and O output tokens (EOS never ends them: the steady batch). With
``--profile``, MLX's own launch (``mx.async_eval`` and ``mx.eval`` from the engine: the
graph handed to MLX and its kernels launched) is its own line, ``mlx_launch``, so the
profile parts the step's host time into MLX's and the engine's Python.

Usage: ``python bench/host_overhead.py --rows 256,1024 --cuda-like [--profile 25]``
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import fmt_num, quiet_logs, set_up_like_mlxq, table


def requests(
    count: int, mix: float, seed: int, uniform: tuple[int, int] | None = None
) -> list[Any]:
    """``count`` greedy requests of varied prompt and output lengths (``mix``: see above),
    or all of ``uniform`` (prompt, output) tokens."""
    from mlxq.wire import Request

    rng = random.Random(seed)
    if uniform is not None:
        prompt, output = uniform
        return [
            Request(prompt=[rng.randrange(3, 250) for _ in range(prompt)], max_tokens=output)
            for _ in range(count)
        ]
    out = []
    for _ in range(count):
        extra: dict[str, Any] = {}
        if rng.random() < mix:
            extra["stop"] = ["never seen \u2603"]
        if rng.random() < mix:
            extra["stream"] = True
        if rng.random() < mix:
            extra["logprobs"] = 2
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(16, 128))]
        out.append(Request(prompt=prompt, max_tokens=rng.randint(16, 256), **extra))
    return out


def run(model: Any, tokenizer: Any, rows: int, args: argparse.Namespace) -> dict[str, float]:
    """One engine of ``rows`` rows through its jobs: host ms per step (module docstring)."""
    from mlxq.engine.sampling import EngineJob
    from mlxq.engine.slots.engine import SlotEngine

    engine = SlotEngine(model, tokenizer, args.preset, max_batch=rows, prefill_batch=args.prefill)
    if args.uniform:
        engine.batch.eos = set()  # (random weights: EOS would end rows at random steps)
    jobs = requests(rows * args.jobs_per_row, args.mix, args.seed, args.uniform)
    queued = list(enumerate(jobs))[::-1]
    joins = [0.0]
    join = engine._join

    def timed_join() -> Any:
        tic = time.thread_time()
        try:
            return join()
        finally:
            joins[0] += time.thread_time() - tic

    engine._join = timed_join  # type: ignore[method-assign]
    full, every, walls, finished = [], [], [], 0
    started = time.perf_counter()
    while queued or engine.active:
        while queued and engine.active < rows + rows // 8:
            i, request = queued.pop()
            assert engine.add(EngineJob(f"j{i}", request)) is None
        decoding, joins[0] = len(engine.batch.rows), 0.0
        tic, wall = time.thread_time(), time.perf_counter()
        finished += len(engine.step())
        wall = time.perf_counter() - wall
        host = time.thread_time() - tic - joins[0]
        every.append(host)
        if decoding >= 0.9 * rows:
            full.append(host)
            if not joins[0]:  # (a join's prefill runs on the device inside the step's wait)
                walls.append(wall)
    assert finished == len(jobs), f"{finished} of {len(jobs)} jobs finished"
    median = statistics.median(full) if full else float("nan")
    stats = engine.stats()
    return {
        "copies": stats.cache_copies,
        "copy_s": stats.cache_copy_seconds,
        "traces": stats.forward_traces,
        "steps": len(every),
        "full": len(full),
        "ms": median * 1e3,
        "us_row": median * 1e6 / rows,
        "wall_ms": statistics.median(walls) * 1e3 if walls else float("nan"),
        "mean_ms": statistics.fmean(every) * 1e3,
        "wall": time.perf_counter() - started,
    }


def load(preset: str) -> tuple[Any, Any]:
    """The preset's random-weight model and tokenizer (``tiny`` through a folder, as the
    tests load it; a larger one in memory, its weights bf16 or float32 as the preset says)."""
    import mlx_lm

    from mlxq.engine.models.make import build_model, make_model

    if preset == "tiny":
        with tempfile.TemporaryDirectory() as tmp:
            return mlx_lm.load(str(make_model(Path(tmp) / "tiny", "tiny")))[:2]
    from common import preset_tokenizer

    return build_model(preset)[0], preset_tokenizer()


def split_launch() -> None:
    """Route the engine's ``mx.async_eval`` and ``mx.eval`` through a Python function of
    their own, so cProfile shows MLX's launch (and the waits in it) apart from our code."""
    import mlx.core as mx

    from mlxq.engine.slots import decoder, joiner, step

    launch, evaluate = mx.async_eval, mx.eval

    def mlx_launch(*arrays: Any) -> None:
        launch(*arrays)

    def mlx_eval(*arrays: Any) -> None:
        evaluate(*arrays)

    shim = type("mx", (), {})()
    for name in dir(mx):
        setattr(shim, name, getattr(mx, name))
    shim.async_eval, shim.eval = mlx_launch, mlx_eval
    for module in (decoder, joiner, step):
        module.mx = shim  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="256,1024", help="batch sizes, comma-separated")
    parser.add_argument("--jobs-per-row", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=64, help="the engine's prefill_batch")
    parser.add_argument("--mix", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cuda-like", action="store_true", help="overlap and compile steps")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--sort", default="tottime", help="the profile's order (pstats keys)")
    parser.add_argument("--preset", default="tiny", help="a random-weight preset")
    parser.add_argument(
        "--uniform",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        metavar="P,O",
        help="every job P prompt and O output tokens",
    )
    args = parser.parse_args()
    if args.cuda_like:
        os.environ["MLXQ_SLOT_OVERLAP"] = os.environ["MLXQ_SLOT_COMPILE"] = "1"
    set_up_like_mlxq()
    quiet_logs()
    model, tokenizer = load(args.preset)
    if args.profile:
        split_launch()
    sizes = [int(s) for s in args.rows.split(",")]
    figures, profile = [], cProfile.Profile(time.thread_time)  # host time only
    for i, rows in enumerate(sizes):
        if args.profile and i == len(sizes) - 1:  # (``--rows 256,256``: the first warms up)
            profile.enable()
        figures.append(run(model, tokenizer, rows, args))
        profile.disable()
    env = {k: os.environ.get(k, "-") for k in ("MLXQ_SLOT_OVERLAP", "MLXQ_SLOT_COMPILE")}
    import mlx.core as mx

    shape = f"uniform {args.uniform}" if args.uniform else f"mix {args.mix}"
    print(f"host time per decode step ({args.preset}, {mx.default_device()}; {env}, {shape})")
    headers = ["rows", "steps", "full steps", "host ms/step", "µs/row", "wall ms/step"]
    headers += ["mean ms (all)", "wall s", "cache copies (s)", "traces"]
    print(
        table(
            headers,
            [
                [
                    str(rows),
                    str(f["steps"]),
                    str(f["full"]),
                    fmt_num(f["ms"], 2),
                    fmt_num(f["us_row"], 2),
                    fmt_num(f["wall_ms"], 2),
                    fmt_num(f["mean_ms"], 2),
                    fmt_num(f["wall"], 1),
                    f"{f['copies']:.0f} ({fmt_num(f['copy_s'], 2)})",
                    f"{f['traces']:.0f}",
                ]
                for rows, f in zip(sizes, figures, strict=True)
            ],
        )
    )
    if args.profile:
        print(f"\ncProfile (main thread CPU time) of the last ({sizes[-1]}-row) run:")
        pstats.Stats(profile, stream=sys.stdout).sort_stats(args.sort).print_stats(args.profile)


if __name__ == "__main__":
    main()
