"""``mlxq worker``: serve a model from Redis queues, and the worker options and profile
merging ``mlxq run`` shares."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from mlxq.cli.support import connect, fail, log_level_option, redis_option
from mlxq.worker.profile import DEFAULTS, STALL_TIMEOUT_S

STALLED_EXIT = 3  # `mlxq worker` exit status when its engine stalled (restart it)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Set up mlxq's logging at ``level``, as text or one JSON object a line."""
    from mlxq import logs

    logs.setup(level, fmt)


def worker_options(f: Callable) -> Callable:
    """The model and engine options ``mlxq worker`` and ``mlxq run`` take."""
    options = [
        click.option(
            "--model",
            multiple=True,
            help="Model to serve: a local folder, a hub id or a .gguf file. Repeat it to serve "
            "several, one loaded at a time (the first loads first).",
        ),
        click.option(
            "--min-model-seconds",
            type=click.FloatRange(0),
            help="With several --model: seconds a model keeps the worker while its queues "
            "have work before another model's waiting jobs take it "
            f"[default: {DEFAULTS.min_model_seconds:g}].",
        ),
        click.option(
            "--profile",
            type=click.Path(exists=True, dir_okay=False),
            help="Worker profile TOML (workers/NAME.toml); flags override it.",
        ),
        click.option(
            "--max-batch",
            type=click.IntRange(1, 4096),
            help="Cap on jobs decoding at once [default: sized from memory].",
        ),
        click.option(
            "--prefill-batch",
            type=click.IntRange(1, 512),
            help="Prompts prefilled together [default: sized from the waiting prompts].",
        ),
        click.option(
            "--memory-fraction",
            type=click.FloatRange(0.05, 0.95),
            help="Share of device memory for weights + KV cache "
            f"[default: {DEFAULTS.memory_fraction}].",
        ),
        click.option(
            "--adapter-path",
            type=click.Path(exists=True),
            help="LoRA adapter folder to serve on top of the model.",
        ),
        click.option(
            "--prefix-cache-fraction",
            type=click.FloatRange(0, 0.5),
            help="Share of the KV budget that keeps shared prompt prefixes for reuse; "
            f"0 turns it off [default: {DEFAULTS.prefix_cache_fraction}].",
        ),
        click.option(
            "--engine",
            type=click.Choice(["slot", "batch_generator"]),
            help="Batch engine [default: slot where the model's cache allows, else "
            "mlx-lm's BatchGenerator].",
        ),
        click.option(
            "--kv-bits",
            type=click.Choice(["8", "4"]),
            callback=lambda _ctx, _param, v: None if v is None else int(v),
            help="Store the KV cache quantized to this many bits: about twice the batch in "
            "the same memory [default: the model's dtype].",
        ),
        click.option(
            "--dequantize",
            type=click.Choice(["auto", "on", "off"]),
            help="Dequantize quantized weights at load [default: auto = on CUDA when they fit, "
            "on the CPU when a timed layer is faster dequantized; kept on Metal].",
        ),
        click.option(
            "--abandon-after",
            type=click.IntRange(3, 3600),
            help="Seconds without a heartbeat before other workers take this worker's jobs "
            f"back [default: {DEFAULTS.abandon_after}].",
        ),
        click.option(
            "--max-job-bytes",
            type=click.IntRange(1024),
            help="Fail, unread, a job whose payload inflates past this many bytes "
            f"[default: {DEFAULTS.max_job_bytes:,}].",
        ),
        click.option(
            "--max-result-bytes",
            type=click.IntRange(1024 * 1024),
            help="Fail, unwritten, a job whose result would store more than this many bytes "
            f"(or than Redis allows) [default: {DEFAULTS.max_result_bytes:,}].",
        ),
        click.option(
            "--grace-period",
            type=click.FloatRange(0),
            help="Seconds to finish running jobs on SIGTERM before putting them back "
            f"[default: {DEFAULTS.grace_period:g}].",
        ),
        click.option(
            "--stall-timeout",
            type=click.FloatRange(1),
            help="Seconds the engine may go without a step while jobs run before the worker "
            f"puts them back and exits with status {STALLED_EXIT} [default: "
            f"{STALL_TIMEOUT_S['metal']:g} on a GPU, {STALL_TIMEOUT_S['cpu']:g} on the CPU].",
        ),
        click.option(
            "--keep-awake/--no-keep-awake",
            default=None,
            help="Keep the Mac from idle sleep while the worker has jobs, as `caffeinate -i` "
            "does; no effect on Linux or other systems [default: on].",
        ),
        log_level_option("info"),
        click.option(
            "--log-format",
            type=click.Choice(["text", "json"]),
            default="text",
            show_default=True,
            help="json: one JSON object per log line (for log shippers).",
        ),
    ]
    return functools.reduce(lambda acc, opt: opt(acc), reversed(options), f)


def worker_profile(profile: str | None, **overrides: Any):  # -> WorkerProfile
    """The ``--profile`` TOML merged with the flags given, or exit 1 saying what is wrong."""
    from mlxq.worker.profile import ProfileError, WorkerProfile, load_profile, merge

    try:
        base = load_profile(profile) if profile else WorkerProfile()
        merged = merge(base, overrides)
    except ProfileError as e:
        fail(str(e))
    if not merged.model:
        fail("no model: pass --model (a local folder or a hub id) or --profile")
    return merged


@click.command()
@worker_options
@click.option(
    "-q",
    "--queue",
    "queues",
    multiple=True,
    help="Queue to serve (repeatable) [default: the model's queue, then 'default'].",
)
@click.option("--burst", is_flag=True, help="Exit once the queues are empty and nothing runs.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics on this port (the metrics extra: pip install -e '.[metrics]').",
)
@click.option("--name", help="Worker name shown by `rq info` [default: random].")
@click.option(
    "--hosts",
    callback=lambda _ctx, _param, v: None if v is None else [h for h in v.split(",") if h],
    help="Split the model over these hosts, comma-separated, this one first: one worker "
    "through MLX's distributed backend (docs/distributed.md).",
)
@click.option(
    "--backend",
    type=click.Choice(["ring", "jaccl"]),
    help="MLX distributed backend for --hosts [default: ring].",
)
@click.option(
    "--parallel",
    type=click.Choice(["auto", "tensor", "pipeline"]),
    help="How --hosts split the model: by heads (tensor: every layer's work shared, two "
    "all_sums a layer, for fast links) or by layers (pipeline: micro-batches in flight, "
    "one send a step) [default: auto: pipeline over ring, tensor over jaccl].",
)
@redis_option
def worker(
    profile: str | None,
    log_level: str,
    log_format: str,
    queues: tuple[str, ...],
    burst: bool,
    redis_url: str,
    **settings: Any,
) -> None:
    """Load a model once and serve generation jobs from Redis queues, continuously batched."""
    from mlxq.worker.launch import run_worker
    from mlxq.worker.watchdog import EngineDied, EngineStalled

    setup_logging(log_level, log_format)
    prof = worker_profile(profile, queues=list(queues), **settings)
    try:
        if prof.hosts:  # one worker over several machines
            from mlxq.worker.distributed_launch import serve

            redis = functools.partial(connect, redis_url, writes_jobs=True)
            sys.exit(serve(prof, redis, burst=burst, log_level=log_level))
        run_worker(prof, connect(redis_url, writes_jobs=True), burst=burst, log_level=log_level)
    except EngineStalled as e:
        fail(f"engine stalled: {e}", code=STALLED_EXIT)
    except EngineDied as e:
        fail(f"{e}; its jobs were put back on their queues: restart the worker")
