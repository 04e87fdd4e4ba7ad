"""The ``mlxq`` command line: submit, worker, run, status, results, server, make-model."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import click
import msgspec
import redis

from mlxq import keys
from mlxq import queue as q
from mlxq.api import api_command
from mlxq.cli_fleet import print_queue_overview, workers
from mlxq.cli_support import connect, fail, redis_option
from mlxq.formats import is_error, to_openai_line
from mlxq.types import BatchStatus, Result, json_encoder

MODEL_COMMANDS = {"worker", "run", "make-model"}


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


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


# -- submit ------------------------------------------------------------------------------
def _read_file(path: str, skip_invalid: bool):  # -> ParsedInput
    from mlxq.inputs import InputFileError, read_requests

    try:
        parsed = read_requests(path, skip_invalid=skip_invalid)
    except InputFileError as e:
        fail(f"{e}\nnothing was enqueued; fix the lines above or pass --skip-invalid")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e}")
    for err in parsed.errors:
        click.echo(f"skipped {path}:{err.line}: {err.message}", err=True)
    return parsed


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option(
    "--queue", "queue_name", help="Queue to submit to [default: the model's, or 'default']."
)
@click.option("--model", help="Model the batch is for; names the default queue.")
@click.option("--skip-invalid", is_flag=True, help="Enqueue the valid lines and report the rest.")
@click.option(
    "--retries",
    type=click.IntRange(0, 20),
    default=0,
    show_default=True,
    help="Times to retry a job that fails.",
)
@click.option(
    "--job-timeout",
    type=click.IntRange(1),
    default=keys.DEFAULT_JOB_TIMEOUT,
    show_default=True,
    help="Seconds one generation may run.",
)
@click.option(
    "--result-ttl",
    type=click.IntRange(60),
    default=keys.DEFAULT_RESULT_TTL,
    show_default=True,
    help="Seconds results are kept in Redis.",
)
@click.option(
    "--expires-in",
    type=click.FloatRange(1),
    help="Seconds after which requests that have not started are not run "
    "(their results say 'expired').",
)
@click.option("--wait", is_flag=True, help="Wait for the batch, with a progress bar.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="With --wait: write the results here (JSONL).",
)
@click.option("--timeout", type=float, help="With --wait: give up after this many seconds.")
@redis_option
def submit(
    file: str,
    queue_name: str | None,
    model: str | None,
    skip_invalid: bool,
    retries: int,
    job_timeout: int,
    result_ttl: int,
    expires_in: float | None,
    wait: bool,
    output: str | None,
    timeout: float | None,
    redis_url: str,
) -> None:
    """Enqueue every request of a JSONL FILE as one batch; prints the batch id last.

    Lines are mlxq requests ({"prompt"|"messages", "max_tokens", ...}) or OpenAI Batch API
    lines ({"custom_id", "method", "url", "body"}). Any invalid line refuses the whole file
    (nothing is enqueued) unless --skip-invalid.
    """
    if output and not wait:
        fail("-o/--output needs --wait (or collect later with `mlxq results BATCH -o FILE`)")
    parsed = _read_file(file, skip_invalid)
    conn = connect(redis_url)
    queue_name = queue_name or keys.queue_name_for_model(model)
    with _bar(len(parsed.requests), "enqueueing") as bar:
        info = q.submit(
            conn,
            parsed.requests,
            queue=queue_name,
            retries=retries,
            job_timeout=job_timeout,
            result_ttl=result_ttl,
            expires_in=expires_in,
            source=file,
            model=model,
            on_progress=bar.update,
        )
    click.echo(f"submitted {info.total} requests to queue {info.queue!r} as batch {info.batch_id}")
    if wait:
        _wait_and_write(conn, info.batch_id, output, timeout)


# -- results and status ------------------------------------------------------------------
@contextlib.contextmanager
def _bar(total: int, label: str) -> Iterator[Any]:
    with click.progressbar(
        length=total, label=label, file=sys.stderr, show_pos=True, show_eta=True, width=30
    ) as bar:
        yield bar


def _wait_with_bar(conn: redis.Redis, batch_id: str, timeout: float | None) -> BatchStatus:
    info = q.get_batch(conn, batch_id)
    start = time.monotonic()
    with _bar(info.total, f"batch {batch_id}") as bar:

        def progress(s: BatchStatus) -> None:
            if sys.stderr.isatty():  # a changing label reprints the line when piped
                bar.label = f"batch {batch_id} ({s.started} running, {s.failed} failed)"
            bar.update(s.done - bar.pos)

        try:
            status = q.wait_for_batch(conn, batch_id, timeout=timeout, on_progress=progress)
        except TimeoutError as e:
            fail(str(e))
    rate = status.total / max(1e-9, time.monotonic() - start)
    click.echo(
        f"batch {batch_id}: {status.finished} finished, {status.failed} failed "
        f"({rate:.1f} requests/s)",
        err=True,
    )
    return status


@dataclass
class OutputFormat:
    """How results are written: mlxq's own lines, or OpenAI Batch output + error lines."""

    kind: str = "mlxq"
    endpoint: str = "/v1/chat/completions"
    errors: str | None = None  # openai: where error lines go (default: beside the output)

    def line(self, result: Result) -> tuple[bool, str]:
        """(is_error_line, JSON text) of one result."""
        if self.kind == "mlxq":
            return False, json_encoder.encode(result).decode()
        data = to_openai_line(result, self.endpoint)
        return is_error(result), json_encoder.encode(data).decode()


def _write_results(
    conn: redis.Redis, batch_id: str, out: TextIO, err: TextIO, fmt: OutputFormat
) -> tuple[int, int]:
    written = missing = 0
    for result in q.iter_batch_results(conn, batch_id):
        if result is None:
            missing += 1
            continue
        to_errors, text = fmt.line(result)
        (err if to_errors else out).write(text + "\n")
        written += 1
    return written, missing


def _wait_and_write(
    conn: redis.Redis, batch_id: str, output: str | None, timeout: float | None
) -> None:
    _wait_with_bar(conn, batch_id, timeout)
    if output:
        _emit_results(conn, batch_id, output)


def _emit_results(
    conn: redis.Redis, batch_id: str, output: str, fmt: OutputFormat | None = None
) -> None:
    fmt = fmt or OutputFormat()
    errors = fmt.errors or (_errors_path(output) if fmt.kind == "openai" else output)
    for path in {output, errors} - {"-"}:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    with click.open_file(output, "w") as out, _same_or_open(errors, output, out) as err:
        written, missing = _write_results(conn, batch_id, out, err, fmt)
    if output != "-":
        also = f" (errors in {errors})" if errors != output else ""
        click.echo(f"wrote {written} results to {output}{also}", err=True)
    if missing:
        fail(
            f"{missing} of {written + missing} requests are not done yet; "
            f"rerun with --wait to wait for them"
        )


def _errors_path(output: str) -> str:
    if output == "-":
        return "-"
    p = Path(output)
    return str(p.with_name(p.stem + "_errors" + (p.suffix or ".jsonl")))


@contextlib.contextmanager
def _same_or_open(path: str, output: str, out: TextIO) -> Iterator[TextIO]:
    if path == output:
        yield out
    else:
        with click.open_file(path, "w") as f:
            yield f


@cli.command()
@click.argument("batch_id")
@click.option(
    "-o",
    "--output",
    default="-",
    type=click.Path(dir_okay=False, allow_dash=True),
    show_default=True,
    help="Where to write the JSONL results.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["mlxq", "openai"]),
    default="mlxq",
    show_default=True,
    help="mlxq result lines, or OpenAI Batch output lines (failed requests go to an "
    "errors file, as OpenAI's error_file).",
)
@click.option(
    "--endpoint",
    type=click.Choice(["/v1/chat/completions", "/v1/completions"]),
    default="/v1/chat/completions",
    show_default=True,
    help="With --format openai: the response body shape.",
)
@click.option(
    "--errors",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="With --format openai: where error lines go [default: OUTPUT_errors.jsonl].",
)
@click.option("--wait", is_flag=True, help="Wait for the batch to finish, with a progress bar.")
@click.option("--timeout", type=float, help="With --wait: give up after this many seconds.")
@redis_option
def results(
    batch_id: str,
    output: str,
    fmt: str,
    endpoint: str,
    errors: str | None,
    wait: bool,
    timeout: float | None,
    redis_url: str,
) -> None:
    """Write a batch's results as JSONL, one line per request in input order."""
    conn = connect(redis_url)
    try:
        if wait:
            _wait_with_bar(conn, batch_id, timeout)
        _emit_results(conn, batch_id, output, OutputFormat(fmt, endpoint, errors))
    except q.BatchNotFound as e:
        fail(str(e))


@cli.command()
@click.argument("batch_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@redis_option
def status(batch_id: str | None, as_json: bool, redis_url: str) -> None:
    """Counts of a batch's jobs: total, queued, started, finished, failed.

    Without BATCH_ID: every queue with its depth and the oldest job's age.
    """
    conn = connect(redis_url)
    if batch_id is None:
        print_queue_overview(conn, as_json)
        return
    try:
        s = q.batch_status(conn, batch_id)
    except q.BatchNotFound as e:
        fail(str(e))
    if as_json:
        click.echo(json_encoder.encode(s).decode())
        return
    click.echo(
        f"batch {batch_id}: {s.done}/{s.total} done — {s.queued} queued, {s.started} "
        f"running, {s.finished} finished, {s.failed} failed, {s.cancelled} cancelled"
    )


def _job_ids(conn: redis.Redis, target: str) -> list[str]:
    """The job ids of a batch, or the one job id given."""
    try:
        return q.batch_job_ids(conn, q.get_batch(conn, target).batch_id)
    except q.BatchNotFound:
        if conn.exists(f"rq:job:{target}"):
            return [target]
    fail(f"no batch or job {target!r} on this Redis (check the id and --redis-url)")
    return []


@cli.command()
@click.argument("target", metavar="BATCH|JOB")
@redis_option
def cancel(target: str, redis_url: str) -> None:
    """Cancel a batch or one job: queued jobs are removed, running ones stop at the next
    step (their results say cancelled). Finished jobs are left alone."""
    conn = connect(redis_url)
    dequeued, flagged = q.cancel_jobs(conn, _job_ids(conn, target))
    click.echo(f"{target}: removed {dequeued} queued jobs, stopping {flagged} running jobs")


@cli.command()
@click.argument("target", metavar="BATCH|JOB")
@redis_option
def retry(target: str, redis_url: str) -> None:
    """Put the failed jobs of a batch (or one failed job) back on their queue."""
    conn = connect(redis_url)
    count = q.retry_failed(conn, _job_ids(conn, target))
    click.echo(f"{target}: re-queued {count} failed jobs")


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
            help="Prompts prefilled together [default: 8].",
        ),
        click.option(
            "--memory-fraction",
            type=click.FloatRange(0.05, 0.95),
            help="Share of device memory for weights + KV cache [default: 0.75].",
        ),
        click.option(
            "--adapter-path",
            type=click.Path(exists=True),
            help="LoRA adapter folder to serve on top of the model.",
        ),
        click.option(
            "--abandon-after",
            type=click.IntRange(3, 3600),
            help="Seconds without a heartbeat before other workers take this worker's jobs "
            "back [default: 30].",
        ),
        click.option(
            "--grace-period",
            type=click.FloatRange(0),
            help="Seconds to finish running jobs on SIGTERM before putting them back "
            "[default: 60].",
        ),
        click.option(
            "--log-level",
            default="INFO",
            show_default=True,
            type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        ),
    ]
    return functools.reduce(lambda acc, opt: opt(acc), reversed(options), f)


def _profile(profile: str | None, **overrides: Any):  # -> WorkerProfile
    from mlxq.profile import ProfileError, WorkerProfile, load_profile, merge

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
    queues: tuple[str, ...],
    burst: bool,
    redis_url: str,
    **settings: Any,
) -> None:
    """Load a model once and serve generation jobs from Redis queues, continuously batched."""
    from mlxq.launch import run_worker

    _setup_logging(log_level)
    prof = _profile(profile, queues=list(queues), **settings)
    conn = connect(redis_url)
    run_worker(prof, conn, burst=burst, log_level=log_level)


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
@click.option(
    "--redis-url",
    envvar=keys.ENV_REDIS_URL,
    show_envvar=True,
    help="Use this Redis instead of a private embedded Valkey.",
)
def run(
    file: str,
    profile: str | None,
    log_level: str,
    output: str,
    skip_invalid: bool,
    redis_url: str | None,
    **settings: Any,
) -> None:
    """Run a JSONL FILE through a model on this machine and write the results.

    With no --redis-url (or MLXQ_REDIS_URL) it starts an embedded Valkey, submits the
    batch, serves it with an in-process worker, writes OUTPUT and stops the server.
    """
    from mlxq.launch import run_worker
    from mlxq.server import embedded

    # A progress bar shows the run; per-job log lines would drown it.
    log_level = "WARNING" if log_level.upper() == "INFO" else log_level
    _setup_logging(log_level)
    prof = _profile(profile, **settings)
    parsed = _read_file(file, skip_invalid)
    server = contextlib.nullcontext(redis_url) if redis_url else embedded()
    with server as url:
        conn = connect(url)
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
        with _bar(len(parsed.requests), "generating") as bar:

            def on_finish(result: Result) -> None:
                tokens[0] += result.usage.completion_tokens
                if sys.stderr.isatty():  # a changing label reprints the line when piped
                    rate = tokens[0] / (time.monotonic() - start)
                    bar.label = f"generating ({rate:.0f} tok/s)"
                bar.update(1)

            run_worker(
                prof,
                conn,
                burst=True,
                queues=[queue_name],
                on_finish=on_finish,
                log_level=log_level,
            )
        s = q.batch_status(conn, batch_id)
        click.echo(
            f"{s.finished} finished, {s.failed} failed in {time.monotonic() - start:.1f}s", err=True
        )
        _emit_results(conn, batch_id, output)


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
    from mlxq.server import make_server

    if host not in ("127.0.0.1", "localhost", "::1") and not password:
        fail(
            f"refusing to listen on {host} without --password: anyone on the network "
            "could read and write your queues"
        )
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
    help="Model shape: tiny, llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b.",
)
@click.option("--seed", type=int, default=0, show_default=True)
def make_model_cmd(dest: Path, preset: str, seed: int) -> None:
    """Write a random-weight model that mlx_lm.load reads (offline tests and benchmarks)."""
    from mlxq.make_model import PRESETS, make_model

    if preset not in PRESETS:
        fail(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    path = make_model(dest, preset=preset, seed=seed)
    click.echo(f"wrote a random-weight {preset} model to {path}")


cli.add_command(workers)
cli.add_command(api_command, name="api")


def main() -> None:
    """Console entry point: speeds up Linux CPU MLX with OpenBLAS for model commands."""
    if len(sys.argv) > 1 and sys.argv[1] in MODEL_COMMANDS:
        from mlxq.blas import reexec_with_openblas

        reexec_with_openblas()
    try:
        cli(standalone_mode=True)
    except msgspec.ValidationError as e:  # pragma: no cover - defensive
        fail(str(e))
