"""The ``mlxq`` command line: the group, worker, run, server, make-model (batch commands in
``cli_batches``, fleet commands in ``cli_fleet``)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mlxq.api import api_command
from mlxq.broker import batches as q
from mlxq.broker import keys
from mlxq.cli.batches import BATCH_COMMANDS, emit_results, progress_bar, read_file
from mlxq.cli.dashboard import dashboard
from mlxq.cli.fleet import workers
from mlxq.cli.support import check_port_free, connect, fail, redis_option
from mlxq.cli.tables import input_options
from mlxq.errors import StartupError
from mlxq.formats.tables import InputOptions
from mlxq.wire import Result, json_encoder
from mlxq.worker.profile import DEFAULTS, STALL_TIMEOUT_S

MODEL_COMMANDS = {"worker", "run", "make-model"}
STALLED_EXIT = 3  # `mlxq worker` exit status when its engine stalled (restart it)


def _setup_logging(level: str, fmt: str = "text") -> None:
    from mlxq import logs

    logs.setup(level, fmt)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="mlxq")
def cli() -> None:
    """Batch LLM inference on Macs: JSONL prompts in, results out, through Redis queues.

    \b
    Quick start, all local (embedded Valkey, nothing else to run):
      mlxq make-model models/tiny --preset tiny
      mlxq run prompts.jsonl --model models/tiny -o results.jsonl
    Across machines: `mlxq server` (or any Redis), `mlxq worker --model M` on each Mac,
    `mlxq submit prompts.jsonl --wait -o results.jsonl` from anywhere.
    """


# -- worker and run ----------------------------------------------------------------------
def _worker_options(f: Callable) -> Callable:
    options = [
        click.option("--model", help="Model to serve: a local folder or a hub id."),
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
            help="Dequantize quantized weights at load [default: auto = on CUDA when they fit].",
        ),
        click.option(
            "--abandon-after",
            type=click.IntRange(3, 3600),
            help="Seconds without a heartbeat before other workers take this worker's jobs "
            f"back [default: {DEFAULTS.abandon_after}].",
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
            "--log-level",
            default="INFO",
            show_default=True,
            type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        ),
        click.option(
            "--log-format",
            type=click.Choice(["text", "json"]),
            default="text",
            show_default=True,
            help="json: one JSON object per log line (for log shippers).",
        ),
    ]
    return functools.reduce(lambda acc, opt: opt(acc), reversed(options), f)


def _profile(profile: str | None, **overrides: Any):  # -> WorkerProfile
    from mlxq.worker.profile import ProfileError, WorkerProfile, load_profile, merge

    try:
        base = load_profile(profile) if profile else WorkerProfile()
        merged = merge(base, overrides)
    except ProfileError as e:
        fail(str(e))
    if not merged.model:
        fail("no model: pass --model (a local folder or a hub id) or --profile")
    return merged


@cli.command()
@_worker_options
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
    help="Serve Prometheus metrics on this port (pip install 'mlxq[metrics]').",
)
@click.option("--name", help="Worker name shown by `rq info` [default: random].")
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
    from mlxq.worker.watchdog import EngineStalled

    _setup_logging(log_level, log_format)
    prof = _profile(profile, queues=list(queues), **settings)
    conn = connect(redis_url, writes_jobs=True)
    try:
        run_worker(prof, conn, burst=burst, log_level=log_level)
    except EngineStalled as e:
        fail(f"engine stalled: {e}", code=STALLED_EXIT)


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@_worker_options
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, allow_dash=True),
    help="Where to write the JSONL results.",
)
@click.option("--skip-invalid", is_flag=True, help="Run the valid lines and report the rest.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary when done.")
@click.option(
    "--redis-url",
    envvar=keys.ENV_REDIS_URL,
    show_envvar=True,
    help="Use this Redis instead of a private embedded Valkey.",
)
@input_options
def run(
    file: str,
    profile: str | None,
    log_level: str,
    log_format: str,
    output: str,
    skip_invalid: bool,
    as_json: bool,
    redis_url: str | None,
    inputs: InputOptions,
    **settings: Any,
) -> None:
    """Run a JSONL FILE (or a CSV/Parquet table, see `mlxq submit`) through a model on this
    machine and write the results.

    With no --redis-url (or MLXQ_REDIS_URL) it starts an embedded Valkey, submits the
    batch, serves it with an in-process worker, writes OUTPUT and stops the server.
    """
    from mlxq.server import embedded
    from mlxq.worker.launch import Setup, run_worker
    from mlxq.worker.watchdog import EngineStalled

    # A progress bar shows the run; per-job log lines would drown it.
    log_level = "WARNING" if log_level.upper() == "INFO" else log_level
    _setup_logging(log_level, log_format)
    prof = _profile(profile, **settings)
    parsed = read_file(file, skip_invalid, inputs)
    # The model loads before the batch exists: a model that cannot load leaves nothing.
    setup = Setup(prof)
    click.echo(f"loading {prof.model}", err=True)
    setup.start()
    server = contextlib.nullcontext(redis_url) if redis_url else embedded()
    with server as url:
        conn = connect(url, writes_jobs=True)
        batch_id = q.new_batch_id()
        queue_name = f"run-{batch_id}"  # private: this run's worker drains exactly this batch
        q.submit(
            conn,
            parsed.requests,
            queue=queue_name,
            batch_id=batch_id,
            source=file,
            model=prof.model,
        )
        click.echo(
            f"running {len(parsed.requests)} requests on {prof.model} (batch {batch_id})", err=True
        )
        start, tokens = time.monotonic(), [0]
        with progress_bar(len(parsed.requests), "generating") as bar:

            def on_finish(result: Result) -> None:
                tokens[0] += result.usage.completion_tokens
                if sys.stderr.isatty():  # a changing label reprints the line when piped
                    rate = tokens[0] / (time.monotonic() - start)
                    bar.label = f"generating ({rate:.0f} tok/s)"
                bar.update(1)

            try:
                run_worker(
                    prof,
                    conn,
                    burst=True,
                    queues=[queue_name],
                    on_finish=on_finish,
                    log_level=log_level,
                    setup=setup,
                )
            except EngineStalled as e:
                fail(f"engine stalled: {e}; rerun (the batch is {batch_id})", code=STALLED_EXIT)
        s = q.batch_status(conn, batch_id)
        elapsed = time.monotonic() - start
        click.echo(f"{s.finished} finished, {s.failed} failed in {elapsed:.1f}s", err=True)
        emit_results(conn, batch_id, output)
    if as_json:  # a summary for scripts, after the results are safely written
        summary = {
            "batch_id": batch_id,
            "total": s.total,
            "finished": s.finished,
            "failed": s.failed,
            "generated_tokens": tokens[0],
            "seconds": round(elapsed, 3),
            "output": output,
        }
        click.echo(json_encoder.encode(summary).decode())


# -- server and make-model ---------------------------------------------------------------
@cli.command()
@click.option("--port", type=int, default=6379, show_default=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on; use 0.0.0.0 (with --password) for other machines.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path.home() / ".mlxq" / "valkey",
    show_default=True,
    help="Where the server persists queues and results.",
)
@click.option("--no-persist", is_flag=True, help="Keep everything in memory only.")
@click.option(
    "--password",
    envvar="MLXQ_SERVER_PASSWORD",
    show_envvar=True,
    help="Require this password (AUTH).",
)
def server(port: int, host: str, data_dir: Path, no_persist: bool, password: str | None) -> None:
    """Run a persistent embedded Valkey server for local workers and submitters."""
    from mlxq.server import is_loopback, make_server

    if not is_loopback(host) and not password:
        fail(
            f"refusing to listen on {host} without --password: anyone on the network "
            "could read and write your queues"
        )
    check_port_free(host, port, "--port")
    srv = make_server(
        port=port, host=host, data_dir=data_dir, persist=not no_persist, password=password
    )
    srv.start()
    where = f"redis://{host}:{srv.port}/0"
    click.echo(f"mlxq server listening on {where} (data in {data_dir}); Ctrl-C to stop", err=True)
    try:
        while srv.is_running():
            time.sleep(1)
        fail("the server exited; see its log in " + str(data_dir / "valkey.log"))
    except KeyboardInterrupt:
        click.echo("stopping (saving data)...", err=True)
    finally:
        if srv.is_running():
            srv.stop(timeout=30)


@cli.command("make-model")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--preset",
    default="tiny",
    show_default=True,
    help="Model shape: tiny (and tiny-qwen2, tiny-qwen3, tiny-mistral, tiny-phi3, "
    "tiny-gemma3), cpu-small, smollm2-135m, llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the path and shape as JSON.")
def make_model_cmd(dest: Path, preset: str, seed: int, as_json: bool) -> None:
    """Write a random-weight model that mlx_lm.load reads (offline tests and benchmarks)."""
    from mlxq.engine.make_model import PRESETS, make_model
    from mlxq.engine.model_source import resolve_model

    if preset not in PRESETS:
        fail(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    path = make_model(dest, preset=preset, seed=seed)
    resolve_model(str(path))  # what `mlxq run --model` will check: refuse a bad output now
    if as_json:
        click.echo(
            json_encoder.encode({"path": str(path), "preset": preset, "seed": seed}).decode()
        )
    else:
        click.echo(f"wrote a random-weight {preset} model to {path}")


for command in (*BATCH_COMMANDS, workers, dashboard):
    cli.add_command(command)
cli.add_command(api_command, name="api")


def _debug_requested(argv: list[str]) -> bool:
    """Whether the command line asks for ``--log-level debug`` (tracebacks included)."""
    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--log-level=") else None
        if arg == "--log-level" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and value.upper() == "DEBUG":
            return True
    return False


def _run_cli() -> None:
    """Run the command; a start-up failure becomes one line on stderr and exit 1."""
    try:
        cli(standalone_mode=True)
    except StartupError as e:
        if _debug_requested(sys.argv):
            traceback.print_exc()
        fail(str(e), e.exit_code)


def main() -> None:
    """Console entry point: speeds up Linux CPU MLX with OpenBLAS for model commands."""
    runs_mlx = len(sys.argv) > 1 and sys.argv[1] in MODEL_COMMANDS
    if runs_mlx:
        from mlxq.engine.blas import reexec_with_openblas

        reexec_with_openblas()
    try:
        _run_cli()
    except SystemExit as e:
        if not runs_mlx:
            raise
        # Everything is written and closed by now. Skip interpreter teardown: MLX's C++
        # threads can abort the process ("terminate called without an active exception")
        # when static destructors race them, turning a clean exit into SIGABRT.
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
