"""The command line of ``bench/throughput.py``: its options, checked, and the modes and
workloads they name."""

from __future__ import annotations

import argparse

from throughput_sweep import parse_batches
from workloads import WORKLOADS

MODES = ("naive", "batch_generate", "raw", "mlxq", "mlxq-bg", "mlxq-direct")
# --prefix-cache: the engine's prefix cache gets this share of the scheduler's KV budget.
PREFIX_CACHE_SHARE = 0.1
# --workload realistic: the headline workloads and their uniform twins.
REALISTIC = ("varied", "varied-twin", "mixed", "mixed-twin")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of a throughput run, checked (``--modes``, ``--workload`` expanded)."""
    from mlxq.engine.models.make import PRESETS

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
        default=None,
        help="mlxq's batch size (also raw's), or comma-separated sizes run side by side on "
        "one workload (e.g. 256,512,auto; ratios against the first); 'auto' or no value: "
        "what mlxq picks on this device (choose_batch)",
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
    try:
        args.batches = parse_batches(args.batch)
    except ValueError as e:
        ap.error(f"--batch: {e}")
    return args
