"""``mlxq run``: run a file through a model on this machine, on an embedded Valkey unless a
Redis is given; interrupted, it resumes when run again (see :mod:`mlxq.cli.run_state`)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec

from mlxq.broker import batches, keys
from mlxq.cli.results import (
    OUTPUT_HELP,
    OutputFormat,
    errors_at,
    fail_on_failures,
    output_format,
    output_options,
    write_output,
)
from mlxq.cli.run_models import (
    first_named,
    models_to_serve,
    named_by,
    private_queues,
    queue_of,
    summed,
)
from mlxq.cli.run_state import (
    RUN_QUEUE_PREFIX,
    RunPlace,
    default_folder,
    find_unfinished,
    run_server,
)
from mlxq.cli.server import stop_on_sigterm
from mlxq.cli.submit import read_file
from mlxq.cli.support import connect, fail, priority_option, progress_bar
from mlxq.cli.tables import input_options
from mlxq.cli.worker import STALLED_EXIT, setup_logging, worker_options, worker_profile
from mlxq.formats.tables import InputOptions
from mlxq.wire import BatchInfo, Request, Result, json_encoder

if TYPE_CHECKING:  # (the worker's modules load MLX: imported where a run needs them)
    import redis

    from mlxq.engine.stats import EngineStats
    from mlxq.worker.launch import Setup
    from mlxq.worker.profile import WorkerProfile

RESUME = "run the same command again to resume"


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@worker_options
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, allow_dash=True),
    help=OUTPUT_HELP,
)
@output_options
@click.option("--skip-invalid", is_flag=True, help="Run the valid lines and report the rest.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary when done.")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the embedded Valkey keeps the batch, so an interrupted run resumes "
    "[default: a folder for this input and model under ~/.mlxq/run, removed once the "
    "output is written].",
)
@click.option(
    "--resume/--no-resume",
    default=True,
    show_default=True,
    help="Continue an unfinished run of the same requests and --model (same --data-dir or "
    "--redis-url): what it finished is not run again.",
)
@click.option(
    "--redis-url",
    envvar=keys.ENV_REDIS_URL,
    show_envvar=True,
    help="Use this Redis instead of a private embedded Valkey.",
)
@priority_option
@input_options
def run(
    file: str,
    profile: str | None,
    log_level: str,
    log_format: str,
    output: str,
    fmt: str | None,
    endpoint: str,
    errors: str | None,
    with_input: bool,
    skip_invalid: bool,
    as_json: bool,
    data_dir: Path | None,
    resume: bool,
    redis_url: str | None,
    priority: str,
    inputs: InputOptions,
    **settings: Any,
) -> None:
    """Run a JSONL FILE (or a CSV/Parquet table, see `mlxq submit`) through a model on this
    machine and write the results to OUTPUT, in input order. Lines may name their models
    (`model`, OpenAI's `body.model`; --model is the model of those that name none): the
    run serves each model in turn, in order of first appearance.

    With no --redis-url (or MLXQ_REDIS_URL) it starts an embedded Valkey (persisting to
    --data-dir), submits the batch, serves it with an in-process worker, writes OUTPUT and
    stops the server. Ctrl-C (or SIGTERM) stops taking requests and finishes the running
    ones (a second Ctrl-C puts them back at once); run the same command again to resume.
    """
    # A progress bar shows the run; per-job log lines would drown it, unless asked for.
    source = click.get_current_context().get_parameter_source("log_level")
    if source is click.core.ParameterSource.DEFAULT:
        log_level = "WARNING"
    setup_logging(log_level, log_format)
    stop_on_sigterm()
    if data_dir is not None and redis_url:
        fail("--data-dir is for the embedded server; with --redis-url the batch stays there")
    out_fmt = output_format(output, fmt, endpoint, errors, with_input)
    parsed = read_file(file, skip_invalid, inputs)
    if not settings.get("model") and not profile:  # the lines name their models
        first = first_named(parsed.requests)
        settings["model"] = (first,) if isinstance(settings.get("model"), tuple) else first
    prof = worker_profile(profile, **settings)
    digest = batches.requests_digest(parsed.requests)
    own = default_folder(file, digest, prof.model or "")
    where = f" (what is done is kept in {data_dir or own})" if not redis_url else ""
    try:
        with run_server(redis_url, data_dir, own) as place:
            _run(
                place,
                prof,
                file,
                parsed.requests,
                resume,
                log_level,
                output,
                out_fmt,
                as_json,
                priority,
            )
    except KeyboardInterrupt:  # outside the worker: loading, submitting, writing
        click.echo("", err=True)
        fail(f"interrupted; {RESUME}{where}")


def take_back(conn: redis.Redis, queue: str) -> None:
    """Put back at once what an earlier run's worker held (killed, it could not): the data
    folder's lock means no other worker of this embedded server lives."""
    from mlxq.broker.recovery import requeue_abandoned, requeue_stranded

    rq_queue = batches.make_queue(conn, queue)
    requeue_abandoned(rq_queue, all_started=True)
    requeue_stranded(rq_queue, 0, at_once=True)


def _run(
    place: RunPlace,
    prof: WorkerProfile,
    file: str,
    requests: list[Request],
    resume: bool,
    log_level: str,
    output: str,
    out_fmt: OutputFormat,
    as_json: bool,
    priority: str,
) -> None:
    """Submit (or resume) the batch, serve it, and write its results."""

    conn = connect(place.url, writes_jobs=True)
    model = prof.model or ""
    digest = batches.requests_digest(requests)
    found = find_unfinished(conn, digest, model, complete_too=place.own_folder) if resume else None
    if found is not None:
        if place.folder is not None:
            for queue in found.queues():
                take_back(conn, queue)
        done = batches.batch_status(conn, found.batch_id).done
        click.echo(
            f"resuming batch {found.batch_id}: {done} of {found.total} requests were done "
            f"before ({place.kept()})",
            err=True,
        )
    # Every model is found, and the first loads, before the batch exists: a model that
    # cannot load leaves nothing.
    models = models_to_serve(requests, model)
    runs = [msgspec.structs.replace(prof, model=m, models=[]) for m in models]
    setups = [_setup(run_prof, conn, requests, model) for run_prof in runs]
    click.echo(f"loading {runs[0].model}", err=True)
    setups[0].start()
    place.holds_batch = True  # from here an interrupted run resumes from its folder
    info = _batch(conn, found, requests, file, model, priority)
    done_before = batches.batch_status(conn, info.batch_id).done
    start = time.monotonic()
    ran, tokens, works = _serve(runs, conn, info, done_before, setups, log_level)
    s = batches.batch_status(conn, info.batch_id)
    elapsed = time.monotonic() - start
    work = summed(works)
    click.echo(
        f"{s.finished} finished, {s.failed} failed in {elapsed:.1f}s: "
        f"{tokens / max(elapsed, 1e-9):,.0f} generated tok/s "
        f"(prefill {work.prefill_seconds:.1f}s, decode {work.decode_seconds:.1f}s)",
        err=True,
    )
    summary = {
        "batch_id": info.batch_id,
        "total": s.total,
        "finished": s.finished,
        "failed": s.failed,
        "done_before": done_before,  # by an earlier, interrupted run
        "ran": ran,  # requests this run generated
        "generated_tokens": tokens,
        "seconds": round(elapsed, 3),
        "output": output,
        # Where the time went: prefill and decode, steps and calls (see EngineStats).
        "engine": msgspec.to_builtins(work),
    }
    if s.done < s.total:
        _echo_summary(summary, as_json)
        fail(
            f"interrupted with {s.total - s.done} of {s.total} requests not done; {RESUME} "
            f"(what is done is kept {place.kept()})"
        )
    write_output(conn, info.batch_id, output, out_fmt)
    place.complete = True
    _echo_summary(summary, as_json)  # for scripts, after the results are safely written
    fail_on_failures(conn, s, errors_at(output, out_fmt))


def _setup(prof: WorkerProfile, conn: redis.Redis, requests: list[Request], default: str):
    """A model's Setup (found and checked, not loaded); a model only lines name that cannot
    be found fails naming those lines and the way to run them on ``--model``."""
    from mlxq.errors import StartupError
    from mlxq.worker.launch import Setup

    try:
        return Setup(prof, conn)
    except StartupError as e:
        if prof.model == default:
            raise
        raise StartupError(  # (the likely fix first: lines naming another service's model)
            f"{named_by(requests, prof.model or '')}, which cannot be loaded here: to run "
            f"every line on --model {default} instead, pass --ignore-line-models ({e})"
        ) from e


def _echo_summary(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json_encoder.encode(summary).decode())


def _batch(
    conn: redis.Redis,
    found: BatchInfo | None,
    requests: list[Request],
    file: str,
    model: str,
    priority: str,
) -> BatchInfo:
    """The batch to serve: ``found`` (its submit finished if it was cut short), or a new
    one on private queues (this run's workers drain exactly this batch), one per model."""
    if found is None:
        batch_id = batches.new_batch_id()
        queue = f"{RUN_QUEUE_PREFIX}{batch_id}"
        return batches.submit(
            conn,
            requests,
            queue=queue,
            batch_id=batch_id,
            source=file,
            model=model,
            priority=priority,
            queue_of=private_queues(queue),
        )
    if found.state != "submitting":
        return found
    try:
        return batches.resume(conn, found.batch_id, requests)[0]
    except (batches.BatchNotFound, batches.ResumeRefused, batches.BatchCancelled) as e:
        fail(str(e))


def _serve(
    runs: list[WorkerProfile],
    conn: redis.Redis,
    info: BatchInfo,
    done_before: int,
    setups: list[Setup],
    log_level: str,
) -> tuple[int, int, list[EngineStats]]:
    """Drain the batch's queues, a model at a time, each with an in-process burst worker,
    behind a progress bar (its label: generated tok/s so far); the requests and tokens this
    run generated, and each engine's work. A signal stops the worker as `mlxq worker` stops
    (no new jobs; running ones finish, or go back at a second signal) and the run with it.
    A stalled engine exits with ``STALLED_EXIT``."""
    from mlxq.worker.launch import run_worker
    from mlxq.worker.watchdog import EngineDied, EngineStalled

    start, ran, tokens, works = time.monotonic(), [0], [0], []
    left = info.total - done_before
    try:
        names = ", ".join(str(p.model) for p in runs)
        click.echo(f"running {left} requests on {names} (batch {info.batch_id})", err=True)
        with progress_bar(info.total, "generating") as bar:
            bar.update(done_before)

            def on_finish(result: Result) -> None:
                ran[0] += 1
                tokens[0] += result.usage.completion_tokens
                if sys.stderr.isatty():  # a changing label reprints the line when piped
                    rate = tokens[0] / (time.monotonic() - start)
                    bar.label = f"generating ({rate:.0f} tok/s)"
                bar.update(1)

            for i, (run_prof, setup) in enumerate(zip(runs, setups, strict=True)):
                if i:  # the previous model was freed when its worker stopped
                    click.echo(f"\nloading {run_prof.model}", err=True)
                    setup.start()
                engine = setup.runner.engine
                assert engine is not None
                before = engine.stats()  # the warmup's work is not the run's
                queue = queue_of(info, str(run_prof.model))
                run_worker(
                    run_prof,
                    conn,
                    burst=True,
                    queues=[queue],
                    on_finish=on_finish,
                    log_level=log_level,
                    setup=setup,
                )
                works.append(engine.stats().since(before))
                if _left_on(conn, info.batch_id, queue):
                    break  # stopped by a signal: the next models wait for the next run
    except EngineStalled as e:
        fail(f"engine stalled: {e}; {RESUME}", code=STALLED_EXIT)
    except EngineDied as e:
        fail(f"{e}; {RESUME}")
    except KeyboardInterrupt:  # before the worker took over Ctrl-C and SIGTERM
        click.echo("", err=True)
    finally:  # the worker's handlers only set flags: a signal from now on interrupts
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stop_on_sigterm()
    return ran[0], tokens[0], works


def _left_on(conn: redis.Redis, batch_id: str, queue: str) -> bool:
    """Whether some of the batch's jobs on ``queue`` still wait or run."""
    for m in batches.batch_status(conn, batch_id).models:
        if m.queue == queue:
            return m.counts["queued"] + m.counts["started"] > 0
    return False
