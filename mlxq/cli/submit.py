"""``mlxq submit``: enqueue a JSONL file or a table as one batch (and the input reading
``mlxq run`` shares)."""

from __future__ import annotations

import time
from typing import Any

import click
import redis

from mlxq.broker import batches, keys, routing
from mlxq.cli.results import (
    OutputFormat,
    errors_at,
    fail_on_failures,
    output_format,
    output_options,
    wait_with_progress,
    write_output,
)
from mlxq.cli.support import age, connect, fail, priority_option, progress_bar, redis_option
from mlxq.cli.tables import input_options
from mlxq.formats.tables import InputOptions
from mlxq.wire import BatchInfo, BatchModel, json_encoder


def read_file(path: str, skip_invalid: bool, inputs: InputOptions | None = None):  # -> ParsedInput
    from mlxq.formats.inputs import InputFileError
    from mlxq.formats.tables import error_place, read_input

    try:
        parsed = read_input(path, inputs or InputOptions(), skip_invalid=skip_invalid)
    except InputFileError as e:
        fail(_refusal(e, "rows" if inputs and inputs.is_table(path) else "lines"))
    except FileNotFoundError:
        fail(f"{path} does not exist (nothing was enqueued)")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e}")
    for err in parsed.errors:
        click.echo(f"skipped {error_place(path, inputs, err.line)}: {err.message}", err=True)
    return parsed


def _refusal(e: Any, what: str) -> str:
    """An input file's errors and what to do: --skip-invalid only where it leaves requests."""
    if e.skippable:
        return f"{e}\nnothing was enqueued; fix the {what} above or pass --skip-invalid"
    if e.errors:
        return f"{e}\nnothing was enqueued; fix the {what} above"
    return f"{e} (nothing was enqueued)"


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option(
    "--queue",
    "queue_name",
    help="Queue of the lines naming no model (and those naming a model its workers serve) "
    "[default: a queue only --model's workers serve, else its own; or 'default'].",
)
@click.option(
    "--model",
    help="Model of the lines that name none: they go to a queue only its workers serve, so "
    "they run on it (a line's own `model` goes to a queue its model's workers serve).",
)
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
@priority_option
@click.option(
    "--resume",
    metavar="BATCH",
    help="Enqueue the rest of a batch whose submit was interrupted (same FILE; the batch "
    "keeps its own queue and settings).",
)
@click.option(
    "--require-workers",
    is_flag=True,
    help="Refuse the file (enqueue nothing) if no live worker serves the queue of some of "
    "its lines [default: warn about lines naming a model nobody serves].",
)
@click.option("--wait", is_flag=True, help="Wait for the batch, with a progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the batch record as JSON.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="With --wait: write the results here, in the format its suffix names (.jsonl, "
    ".csv, .parquet; or --format).",
)
@output_options
@click.option("--timeout", type=float, help="With --wait: give up after this many seconds.")
@input_options
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
    priority: str,
    resume: str | None,
    require_workers: bool,
    wait: bool,
    as_json: bool,
    output: str | None,
    fmt: str | None,
    endpoint: str,
    errors: str | None,
    with_input: bool,
    timeout: float | None,
    redis_url: str,
    inputs: InputOptions,
) -> None:
    """Enqueue every request of a JSONL FILE, or every row of a table, as one batch; prints
    the batch id first (on stderr, before enqueueing) and last.

    Lines are mlxq requests ({"prompt"|"messages", "max_tokens", ...}) or OpenAI Batch API
    lines ({"custom_id", "method", "url", "body"}). A CSV, TSV or Parquet FILE (or JSONL with
    --template) is a table: each row's prompt is --template filled from its columns. Any
    invalid line or row refuses the whole file (nothing is enqueued) unless --skip-invalid.
    A submit cut short leaves its batch `submitting`: finish it with --resume BATCH (same
    FILE and options), or remove it with `mlxq cancel BATCH`.
    """
    if output and not wait:
        fail("-o/--output needs --wait (or collect later with `mlxq results BATCH -o FILE`)")
    out_fmt = output_format(output, fmt, endpoint, errors, with_input) if output else None
    if resume:
        _refuse_settings_with_resume(click.get_current_context())
    parsed = read_file(file, skip_invalid, inputs)
    conn = connect(redis_url, writes_jobs=True)
    workers = routing.Fleet.read(conn)
    if resume:
        first = _batch_of(conn, resume)
        _check_served(workers, _plan_of(first), first.model, require_workers)
        info = _resume(conn, resume, parsed.requests)
    else:
        queue = queue_name or routing.batch_queue(model, workers)
        plan = routing.plan(
            parsed.requests, queue, model, fleet=workers, given=queue_name is not None
        )
        _check_served(workers, plan, model, require_workers)
        info = _submit_new(
            conn,
            file,
            parsed.requests,
            queue=queue,
            retries=retries,
            job_timeout=job_timeout,
            result_ttl=result_ttl,
            expires_in=expires_in,
            model=model,
            priority=priority,
            models=plan,
        )
    if as_json:
        click.echo(json_encoder.encode(info).decode())
    else:
        click.echo(f"submitted {info.total} requests to {_queues(info)} as batch {info.batch_id}")
    if wait:
        _wait_and_write(conn, info.batch_id, output, out_fmt, timeout)


def _queues(info: BatchInfo) -> str:
    """``queue 'A'``, or ``queues 'A' (3), 'default' (2)``: where the batch's lines went."""
    names = info.queues()
    if len(names) == 1:
        return f"queue {names[0]!r}"
    lines = {name: 0 for name in names}
    for m in info.models:
        lines[m.queue] += m.lines
    return "queues " + ", ".join(f"{name!r} ({n})" for name, n in lines.items())


def _batch_of(conn: redis.Redis, batch_id: str) -> BatchInfo:
    try:
        return batches.get_batch(conn, batch_id)
    except batches.BatchNotFound as e:
        fail(str(e))


def _plan_of(info: BatchInfo) -> list[BatchModel]:
    """The queues a batch's lines go to, as its first submit planned them."""
    return info.models or [BatchModel(queue=info.queue, lines=info.total, model=info.model)]


def _check_served(
    workers: routing.Fleet, plan: list[BatchModel], model: str | None, require: bool
) -> None:
    """Name the lines no live worker would take: all of them refuse the file with
    ``require``; else a warning (a note where a worker that ran them was seen lately: a
    fleet asleep), and a warning for lines naming no model whose queue's workers run
    several models."""
    missing = routing.unserved(plan, workers, model)
    if require and missing:
        fail(
            f"no live worker serves {routing.describe(missing, model)}; nothing was enqueued "
            "(start `mlxq worker --model MODEL` for each, or submit without --require-workers)"
        )
    recent = [m for m in missing if not routing.unserved([m], workers, model, live=None)]
    never = [m for m in missing if m not in recent]
    if never:
        served = "; ".join(
            f"{m!r} on {', '.join(map(repr, qs))}" for m, qs in workers.models_served()
        )
        now = f" (live workers serve {served})" if served else ""
        ignore = any(m.model for m in never)
        click.echo(
            f"warning: no live worker serves {routing.describe(never, model)}{now}; they "
            "wait until one starts (`mlxq worker --model MODEL`; --require-workers refuses "
            "instead"
            + ("; --ignore-line-models runs every line on the batch's queue)" if ignore else ")"),
            err=True,
        )
    for m in recent:
        at = routing.last_seen(workers, m, model)
        when = f", last seen {age(max(0.0, time.time() - at))} ago" if at is not None else ""
        click.echo(
            f"note: no live worker serves {routing.describe([m], model)} now; they wait for "
            f"the workers that did{when}",
            err=True,
        )
    for m, runs in routing.mixed(plan, workers):
        pins = (
            f"--model {model!r} pins them only on a queue that its workers alone serve"
            if model
            else "--model MODEL pins them to one model's workers"
        )
        click.echo(
            f"warning: {routing.describe([m])}: its workers run "
            f"{', '.join(map(repr, runs))}, so their answers will mix models; {pins}",
            err=True,
        )


_BATCH_SETTINGS = (
    "queue_name",
    "model",
    "retries",
    "job_timeout",
    "result_ttl",
    "expires_in",
    "priority",
)


def _refuse_settings_with_resume(ctx: click.Context) -> None:
    given = [
        f"--{name.replace('_name', '').replace('_', '-')}"
        for name in _BATCH_SETTINGS
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        fail(f"--resume keeps the batch's own settings; drop {', '.join(given)}")


def _submit_new(conn: redis.Redis, file: str, requests: list, **settings: Any):  # -> BatchInfo
    def created(info: Any) -> None:
        click.echo(
            f"batch {info.batch_id}: enqueueing {info.total} requests to {_queues(info)} "
            f"(if this stops, finish with `mlxq submit {file} --resume {info.batch_id}`)",
            err=True,
        )

    with progress_bar(len(requests), "enqueueing") as bar:
        try:
            return batches.submit(
                conn, requests, source=file, on_progress=bar.update, on_created=created, **settings
            )
        except batches.BatchCancelled as e:
            fail(f"{e}; its enqueued requests were cancelled")


def _resume(conn: redis.Redis, batch_id: str, requests: list):  # -> BatchInfo
    with progress_bar(len(requests), f"resuming {batch_id}") as bar:
        try:
            info, already = batches.resume(conn, batch_id, requests, on_progress=bar.update)
        except (batches.BatchNotFound, batches.ResumeRefused, batches.BatchCancelled) as e:
            fail(str(e))
    click.echo(
        f"batch {batch_id}: {already} requests were enqueued before, {info.total - already} now",
        err=True,
    )
    return info


def _wait_and_write(
    conn: redis.Redis,
    batch_id: str,
    output: str | None,
    out_fmt: OutputFormat | None,
    timeout: float | None,
) -> None:
    status = wait_with_progress(conn, batch_id, timeout)
    if output and out_fmt:
        write_output(conn, batch_id, output, out_fmt)
    fail_on_failures(conn, status, errors_at(output, out_fmt) if output and out_fmt else None)
