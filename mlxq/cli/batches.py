"""Batch commands: submit, results, status, cancel, retry (and the helpers ``run`` shares)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import click
import redis

from mlxq.broker import batches as q
from mlxq.broker import fleet, keys
from mlxq.broker.rq_store import reads
from mlxq.cli.fleet import print_queue_overview
from mlxq.cli.support import connect, fail, redis_option
from mlxq.cli.tables import emit_table, input_options
from mlxq.formats.openai_output import ENDPOINTS, is_error, to_openai_line
from mlxq.formats.table_output import TABLE_FORMATS
from mlxq.formats.tables import InputOptions
from mlxq.wire import BatchStatus, Result, json_encoder


# -- submit ------------------------------------------------------------------------------
def read_file(path: str, skip_invalid: bool, inputs: InputOptions | None = None):  # -> ParsedInput
    from mlxq.formats.inputs import InputFileError
    from mlxq.formats.tables import error_place, read_input

    try:
        parsed = read_input(path, inputs or InputOptions(), skip_invalid=skip_invalid)
    except InputFileError as e:
        what = "rows" if inputs and inputs.is_table(path) else "lines"
        fail(f"{e}\nnothing was enqueued; fix the {what} above or pass --skip-invalid")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e}")
    for err in parsed.errors:
        click.echo(f"skipped {error_place(path, inputs, err.line)}: {err.message}", err=True)
    return parsed


@click.command()
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
@click.option(
    "--resume",
    metavar="BATCH",
    help="Enqueue the rest of a batch whose submit was interrupted (same FILE; the batch "
    "keeps its own queue and settings).",
)
@click.option("--wait", is_flag=True, help="Wait for the batch, with a progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the batch record as JSON.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="With --wait: write the results here (JSONL).",
)
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
    resume: str | None,
    wait: bool,
    as_json: bool,
    output: str | None,
    timeout: float | None,
    redis_url: str,
    inputs: InputOptions,
) -> None:
    """Enqueue every request of a JSONL FILE, or every row of a table, as one batch; prints
    the batch id first (on stderr, before enqueueing) and last.

    Lines are mlxq requests ({"prompt"|"messages", "max_tokens", ...}) or OpenAI Batch API
    lines ({"custom_id", "method", "url", "body"}). A CSV or Parquet FILE (or JSONL with
    --template) is a table: each row's prompt is --template filled from its columns. Any
    invalid line or row refuses the whole file (nothing is enqueued) unless --skip-invalid.
    A submit cut short leaves its batch `submitting`: finish it with --resume BATCH (same
    FILE and options), or remove it with `mlxq cancel BATCH`.
    """
    if output and not wait:
        fail("-o/--output needs --wait (or collect later with `mlxq results BATCH -o FILE`)")
    if resume:
        _refuse_settings_with_resume(click.get_current_context())
    parsed = read_file(file, skip_invalid, inputs)
    conn = connect(redis_url, writes_jobs=True)
    if resume:
        info = _resume(conn, resume, parsed.requests)
    else:
        info = _submit_new(
            conn,
            file,
            parsed.requests,
            queue=queue_name or keys.queue_name_for_model(model),
            retries=retries,
            job_timeout=job_timeout,
            result_ttl=result_ttl,
            expires_in=expires_in,
            model=model,
        )
    if as_json:
        click.echo(json_encoder.encode(info).decode())
    else:
        click.echo(
            f"submitted {info.total} requests to queue {info.queue!r} as batch {info.batch_id}"
        )
    if wait:
        _wait_and_write(conn, info.batch_id, output, timeout)


_BATCH_SETTINGS = ("queue_name", "model", "retries", "job_timeout", "result_ttl", "expires_in")


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
            f"batch {info.batch_id}: enqueueing {info.total} requests to queue {info.queue!r} "
            f"(if this stops, finish with `mlxq submit {file} --resume {info.batch_id}`)",
            err=True,
        )

    with progress_bar(len(requests), "enqueueing") as bar:
        try:
            return q.submit(
                conn, requests, source=file, on_progress=bar.update, on_created=created, **settings
            )
        except q.BatchCancelled as e:
            fail(f"{e}; its enqueued requests were cancelled")


def _resume(conn: redis.Redis, batch_id: str, requests: list):  # -> BatchInfo
    with progress_bar(len(requests), f"resuming {batch_id}") as bar:
        try:
            info, already = q.resume(conn, batch_id, requests, on_progress=bar.update)
        except (q.BatchNotFound, q.ResumeRefused, q.BatchCancelled) as e:
            fail(str(e))
    click.echo(
        f"batch {batch_id}: {already} requests were enqueued before, {info.total - already} now",
        err=True,
    )
    return info


# -- results and status ------------------------------------------------------------------
@contextlib.contextmanager
def progress_bar(total: int, label: str) -> Iterator[Any]:
    with click.progressbar(
        length=total, label=label, file=sys.stderr, show_pos=True, show_eta=True, width=30
    ) as bar:
        yield bar


def _wait_with_progress(conn: redis.Redis, batch_id: str, timeout: float | None) -> BatchStatus:
    info = q.get_batch(conn, batch_id)
    start = time.monotonic()
    with progress_bar(info.total, f"batch {batch_id}") as bar:

        def progress(s: BatchStatus) -> None:
            if sys.stderr.isatty():  # a changing label reprints the line when piped
                tps = _queue_tps(conn, info.queue)
                bar.label = (
                    f"batch {batch_id} ({s.started} running, {s.failed} failed, {tps:,.0f} tok/s)"
                )
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


def _queue_tps(conn: redis.Redis, queue: str) -> float:
    """Recent tokens/s of the live workers serving ``queue`` (what they publish)."""
    try:
        return sum(w.recent_tps for w in fleet.live_workers(conn) if queue in w.queues)
    except redis.RedisError:
        return 0.0


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
    _wait_with_progress(conn, batch_id, timeout)
    if output:
        emit_results(conn, batch_id, output)


def emit_results(
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


@click.command()
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
    type=click.Choice(["mlxq", "openai", *TABLE_FORMATS]),
    default="mlxq",
    show_default=True,
    help="mlxq result lines, OpenAI Batch output lines (failed requests go to an "
    "errors file, as OpenAI's error_file), or a CSV/Parquet table (one row per request).",
)
@click.option(
    "--endpoint",
    type=click.Choice(ENDPOINTS),
    default=ENDPOINTS[0],
    show_default=True,
    help="With --format openai: the response body shape.",
)
@click.option(
    "--errors",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="With --format openai: where error lines go [default: OUTPUT_errors.jsonl].",
)
@click.option("--with-input", is_flag=True, help="With csv/parquet: add the input row's columns.")
@click.option("--wait", is_flag=True, help="Wait for the batch to finish, with a progress bar.")
@click.option("--timeout", type=float, help="With --wait: give up after this many seconds.")
@redis_option
def results(
    batch_id: str,
    output: str,
    fmt: str,
    endpoint: str,
    errors: str | None,
    with_input: bool,
    wait: bool,
    timeout: float | None,
    redis_url: str,
) -> None:
    """Write a batch's results, one line (or table row) per request in input order."""
    if with_input and fmt not in TABLE_FORMATS:
        fail("--with-input applies to --format csv or parquet")
    conn = connect(redis_url)
    try:
        if wait:
            _wait_with_progress(conn, batch_id, timeout)
        if fmt in TABLE_FORMATS:
            emit_table(conn, batch_id, output, fmt, with_input)
            return
        emit_results(conn, batch_id, output, OutputFormat(fmt, endpoint, errors))
    except q.BatchNotFound as e:
        fail(str(e))


@click.command()
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
    if s.state != "submitted":
        click.echo(_incomplete(s, q.get_batch(conn, batch_id).source))


def _incomplete(s: BatchStatus, source: str | None) -> str:
    """What to say of a batch not fully enqueued."""
    head = f"batch {s.batch_id}: only {s.enqueued} of {s.total} requests were enqueued"
    if s.state == "cancelled":
        return f"{head}; it was cancelled while being submitted"
    if s.submitter_alive:
        return f"batch {s.batch_id}: still being submitted ({s.enqueued} of {s.total} enqueued)"
    return (
        f"{head}: its submit stopped; finish it with `mlxq submit {source or 'FILE'} "
        f"--resume {s.batch_id}`, or remove it with `mlxq cancel {s.batch_id}`"
    )


def _is_batch(conn: redis.Redis, target: str) -> bool:
    """Whether ``target`` is a batch id (else a job id), or exit saying it is neither."""
    try:
        q.get_batch(conn, target)
        return True
    except q.BatchNotFound:
        if reads.job_exists(conn, target):
            return False
    fail(f"no batch or job {target!r} on this Redis (check the id and --redis-url)")


def _job_ids(conn: redis.Redis, target: str) -> list[str]:
    """The job ids of a batch, or the one job id given."""
    return q.batch_job_ids(conn, target) if _is_batch(conn, target) else [target]


@click.command()
@click.argument("target", metavar="BATCH|JOB")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@redis_option
def cancel(target: str, as_json: bool, redis_url: str) -> None:
    """Cancel a batch or one job: queued jobs are removed, running ones stop at the next
    step (their results say cancelled). Finished jobs are left alone."""
    conn = connect(redis_url)
    if _is_batch(conn, target):
        dequeued, flagged = q.cancel_batch(conn, target)
    else:
        dequeued, flagged = q.cancel_jobs(conn, [target])
    if as_json:
        click.echo(json_encoder.encode({"removed": dequeued, "stopping": flagged}).decode())
    else:
        click.echo(f"{target}: removed {dequeued} queued jobs, stopping {flagged} running jobs")


@click.command()
@click.argument("target", metavar="BATCH|JOB")
@click.option("--json", "as_json", is_flag=True, help="Print the count as JSON.")
@redis_option
def retry(target: str, as_json: bool, redis_url: str) -> None:
    """Put the failed jobs of a batch (or one failed job) back on their queue."""
    conn = connect(redis_url)
    count = q.retry_failed(conn, _job_ids(conn, target))
    if as_json:
        click.echo(json_encoder.encode({"requeued": count}).decode())
    else:
        click.echo(f"{target}: re-queued {count} failed jobs")


@click.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print each stream entry as JSON.")
@redis_option
def tail(job_id: str, as_json: bool, redis_url: str) -> None:
    """Follow a `stream: true` job's output as it is generated, until it ends."""
    from mlxq.broker import streams

    conn = connect(redis_url)
    if not reads.job_exists(conn, job_id) and not conn.exists(keys.stream(job_id)):
        fail(f"no job {job_id!r} on this Redis (check the id and --redis-url)")
    reason = None
    for entry in streams.follow(conn, job_id):
        if as_json:
            click.echo(json_encoder.encode(entry).decode())
        else:
            click.echo(entry.text, nl=False)
        reason = entry.finish_reason or reason
    if not as_json:
        click.echo("")
    if reason is None:
        fail(f'job {job_id} ended without streaming (submit it with "stream": true)')
    click.echo(f"[{reason}]", err=True)


BATCH_COMMANDS = (submit, results, status, cancel, retry, tail)
