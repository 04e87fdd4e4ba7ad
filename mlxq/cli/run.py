"""``mlxq run``: run a file through a model on this machine, on an embedded Valkey unless a
Redis is given."""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import click
import msgspec

from mlxq.broker import batches as q
from mlxq.broker import keys
from mlxq.cli.results import emit_results
from mlxq.cli.server import stop_on_sigterm
from mlxq.cli.submit import read_file
from mlxq.cli.support import connect, fail, progress_bar
from mlxq.cli.tables import input_options
from mlxq.cli.worker import STALLED_EXIT, setup_logging, worker_options, worker_profile
from mlxq.formats.openai_output import is_success
from mlxq.formats.tables import InputOptions
from mlxq.wire import Result, json_encoder

if TYPE_CHECKING:  # (the worker's modules load MLX: imported where a run needs them)
    import redis

    from mlxq.worker.launch import Setup
    from mlxq.worker.profile import WorkerProfile


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@worker_options
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
    from mlxq.worker.launch import Setup

    # A progress bar shows the run; per-job log lines would drown it, unless asked for.
    source = click.get_current_context().get_parameter_source("log_level")
    if source is click.core.ParameterSource.DEFAULT:
        log_level = "WARNING"
    setup_logging(log_level, log_format)
    stop_on_sigterm()
    prof = worker_profile(profile, **settings)
    parsed = read_file(file, skip_invalid, inputs)
    # The model loads before the batch exists: a model that cannot load leaves nothing.
    setup = Setup(prof)
    click.echo(f"loading {prof.model}", err=True)
    setup.start()
    engine = setup.runner.engine
    assert engine is not None
    before = engine.stats()  # the warmup's work is not the run's
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
        start = time.monotonic()
        tokens = _serve(prof, conn, queue_name, batch_id, len(parsed.requests), setup, log_level)
        s = q.batch_status(conn, batch_id)
        elapsed = time.monotonic() - start
        work = engine.stats().since(before)
        click.echo(
            f"{s.finished} finished, {s.failed} failed in {elapsed:.1f}s: "
            f"{tokens / max(elapsed, 1e-9):,.0f} generated tok/s "
            f"(prefill {work.prefill_seconds:.1f}s, decode {work.decode_seconds:.1f}s)",
            err=True,
        )
        unfinished = _unfinished_hint(redis_url, queue_name, batch_id, prof.model, output)
        emit_results(conn, batch_id, output, unfinished=unfinished)
        failures = _failures(conn, batch_id) if s.failed else None
    if as_json:  # a summary for scripts, after the results are safely written
        summary = {
            "batch_id": batch_id,
            "total": s.total,
            "finished": s.finished,
            "failed": s.failed,
            "generated_tokens": tokens,
            "seconds": round(elapsed, 3),
            "output": output,
            # Where the time went: prefill and decode, steps and calls (see EngineStats).
            "engine": msgspec.to_builtins(work),
        }
        click.echo(json_encoder.encode(summary).decode())
    if failures:
        fail(f"{s.failed} of {s.total} requests failed: {failures} (error lines in {output})")


def _unfinished_hint(
    redis_url: str | None, queue: str, batch_id: str, model: str, output: str
) -> str:
    """How to get the requests an interrupted run left undone."""
    if redis_url is None:  # the private server stops with the run: nothing stays queued
        return "the run was interrupted and its embedded server is gone: run the command again"
    return (
        f"they stay queued on {queue!r}: `mlxq worker --model {model} -q {queue} --burst` "
        f"runs them, then `mlxq results {batch_id} -o {output}` writes them all"
    )


def _failures(conn: redis.Redis, batch_id: str, most: int = 3) -> str:
    """The failed requests' reasons, the commonest first: ``2x reason; 1x other``. Reasons
    that differ only in their numbers count as one (the first one is shown)."""
    kinds: Counter[str] = Counter()
    shown: dict[str, str] = {}
    for r in q.iter_batch_results(conn, batch_id):
        if r is not None and not is_success(r):
            reason = r.error or r.finish_reason
            kind = re.sub(r"\d+", "#", reason)
            kinds[kind] += 1
            shown.setdefault(kind, reason)
    listed = [f"{n}x {_clip(shown[kind])}" for kind, n in kinds.most_common(most)]
    if len(kinds) > most:
        listed.append(f"and {len(kinds) - most} other reasons")
    return "; ".join(listed)


def _clip(text: str, width: int = 240) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _serve(
    prof: WorkerProfile,
    conn: redis.Redis,
    queue_name: str,
    batch_id: str,
    total: int,
    setup: Setup,
    log_level: str,
) -> int:
    """Drain this run's queue with an in-process burst worker behind a progress bar (its
    label: generated tok/s so far); the tokens generated. A stalled engine exits with
    ``STALLED_EXIT``, naming the batch."""
    from mlxq.worker.launch import run_worker
    from mlxq.worker.watchdog import EngineStalled

    start, tokens = time.monotonic(), [0]
    try:
        click.echo(f"running {total} requests on {prof.model} (batch {batch_id})", err=True)
        with progress_bar(total, "generating") as bar:

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
                setup=setup,
            )
    except EngineStalled as e:
        fail(f"engine stalled: {e}; rerun (the batch is {batch_id})", code=STALLED_EXIT)
    except KeyboardInterrupt:  # before the worker took over Ctrl-C and SIGTERM, or after
        click.echo("interrupted", err=True)
    return tokens[0]
