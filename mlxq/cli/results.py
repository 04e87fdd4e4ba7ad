"""Reading a batch: ``mlxq results`` (write its results) and waiting on it with a progress
bar (``--wait``); ``mlxq status`` is in :mod:`mlxq.cli.status`."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import click
import redis

from mlxq.broker import batches, failures, fleet, routing
from mlxq.cli.support import connect, fail, progress_bar, redis_errors, redis_option
from mlxq.cli.tables import emit_table
from mlxq.formats.openai_output import ENDPOINTS, is_error, to_openai_line
from mlxq.formats.table_output import TABLE_FORMATS
from mlxq.wire import BatchInfo, BatchStatus, Result, json_encoder


# -- waiting -----------------------------------------------------------------------------
def wait_with_progress(conn: redis.Redis, batch_id: str, timeout: float | None) -> BatchStatus:
    """Wait for a batch with a progress bar on stderr; on ``timeout`` or Ctrl-C, exit
    non-zero saying how far it is and how to wait again."""
    info = batches.get_batch(conn, batch_id)
    start, done_before = time.monotonic(), batches.batch_status(conn, batch_id).done
    try:
        status = _wait(conn, info, timeout)
    except TimeoutError:
        fail(_not_done(conn, info, f"after {timeout:g}s"))
    except KeyboardInterrupt:
        click.echo("", err=True)  # off the progress bar's line
        fail(_not_done(conn, info, "when interrupted"), code=130)
    # A rate over the requests done while it waited (none for a batch already done).
    waited, ended = time.monotonic() - start, status.done - done_before
    rate = f" ({ended / waited:.1f} requests/s while waiting)" if ended and waited > 0.5 else ""
    click.echo(
        f"batch {batch_id}: {status.finished} finished, {status.failed} failed{rate}", err=True
    )
    return status


def _wait(conn: redis.Redis, info: BatchInfo, timeout: float | None) -> BatchStatus:
    batch_id = info.batch_id
    with progress_bar(info.total, f"batch {batch_id}") as bar:

        def progress(s: BatchStatus) -> None:
            if sys.stderr.isatty():  # a changing label reprints the line when piped
                tps = _queue_tps(conn, info.queues())
                bar.label = (
                    f"batch {batch_id} ({s.started} running, {s.failed} failed, {tps:,.0f} tok/s)"
                )
            bar.update(s.done - bar.pos)

        return batches.wait_for_batch(conn, batch_id, timeout=timeout, on_progress=progress)


def _not_done(conn: redis.Redis, info: BatchInfo, when: str) -> str:
    """A batch stopped being waited on: how far it is, whether workers serve its queue,
    and how to wait again."""
    again = f"`mlxq results {info.batch_id} --wait -o FILE`"
    try:
        s = batches.batch_status(conn, info.batch_id)
        workers = fleet.live_workers(conn)
    except redis.RedisError as e:
        return f"batch {info.batch_id}: not done {when} (Redis: {e}); wait again with {again}"
    head = f"batch {info.batch_id}: {s.done} of {s.total} done {when}"
    models = routing.model_names(info)
    for queue in info.queues():
        if not any(queue in w.queues for w in workers):
            model = models.get(queue, ["(none)"])[0]
            flag = f" --model {model}" if model != "(none)" else ""
            return (
                f"{head}; no live worker serves queue {queue!r}: start one (`mlxq worker"
                f"{flag} -q {queue}`), then wait with {again}"
            )
    serving = [w.name for w in workers if set(info.queues()) & set(w.queues)]
    queues = ", ".join(repr(name) for name in info.queues())
    return (
        f"{head}; it keeps running on {len(serving)} live worker(s) of queue {queues} "
        f"({', '.join(serving[:3])}{', ...' if len(serving) > 3 else ''}): wait again with "
        f"{again}, or see `mlxq status {info.batch_id}`"
    )


def fail_on_failures(conn: redis.Redis, status: BatchStatus, output: str | None) -> None:
    """Exit 1, with the commonest reasons, if some of a waited-on batch's requests failed."""
    if not status.failed:
        return
    where = f"error lines in {output}" if output and output != "-" else "their results say why"
    fail(
        f"{status.failed} of {status.total} requests failed: "
        f"{failure_line(conn, status.batch_id)} ({where})"
    )


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def failure_line(conn: redis.Redis, batch_id: str, width: int = 240) -> str:
    """The batch's failure reasons in one line, the commonest first: ``2x reason; 1x other``
    (reasons that differ only in their numbers count as one; ``failures``)."""
    summary = failures.failure_reasons(conn, batch_id)
    listed = [f"{r.count}x {_clip(r.message, width)}" for r in summary.reasons]
    if summary.others:
        listed.append(f"and {summary.others} more")
    return "; ".join(listed)


def _queue_tps(conn: redis.Redis, queues: list[str]) -> float:
    """Recent tokens/s of the live workers serving ``queues`` (what they publish)."""
    try:
        return sum(w.recent_tps for w in fleet.live_workers(conn) if set(queues) & set(w.queues))
    except redis.RedisError:
        return 0.0


# -- writing results ---------------------------------------------------------------------
@dataclass
class OutputFormat:
    """How results are written: mlxq's own lines, OpenAI Batch output + error lines, or a
    CSV/Parquet table (``kind`` in ``TABLE_FORMATS``)."""

    kind: str = "mlxq"
    endpoint: str = "/v1/chat/completions"
    errors: str | None = None  # openai: where error lines go (default: beside the output)
    with_input: bool = False  # tables: add the input row's columns

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
    for result in batches.iter_batch_results(conn, batch_id):
        if result is None:
            missing += 1
            continue
        to_errors, text = fmt.line(result)
        (err if to_errors else out).write(text + "\n")
        written += 1
    return written, missing


def emit_results(
    conn: redis.Redis,
    batch_id: str,
    output: str,
    fmt: OutputFormat | None = None,
    unfinished: str = "rerun with --wait to wait for them",
) -> None:
    """Write the batch's results to ``output``; fails naming ``unfinished`` (how to get
    the rest) if some requests are not done."""
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
        fail(f"{missing} of {written + missing} requests are not done yet; {unfinished}")


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


# Output suffixes that name a format; any other suffix gets JSONL lines, with a note.
SUFFIX_FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
JSONL_SUFFIXES = ("", ".jsonl", ".json", ".ndjson")

OUTPUT_HELP = (
    "Where to write the results; its suffix picks the format unless --format does: .csv or "
    ".parquet a table, anything else JSONL lines (a suffix other than .jsonl/.json/.ndjson "
    "gets a note)."
)


def output_options(f: Callable) -> Callable:
    """``--format``, ``--endpoint``, ``--errors`` and ``--with-input``, as ``mlxq results``
    and ``mlxq run`` take them (read with :func:`output_format`)."""
    options = [
        click.option(
            "--format",
            "fmt",
            type=click.Choice(["mlxq", "openai", *TABLE_FORMATS]),
            help="mlxq result lines, OpenAI Batch output lines (failed requests go to an "
            "errors file, as OpenAI's error_file), or a CSV/Parquet table (one row per "
            "request) [default: from the output's suffix; mlxq lines on stdout].",
        ),
        click.option(
            "--endpoint",
            type=click.Choice(ENDPOINTS),
            default=ENDPOINTS[0],
            show_default=True,
            help="With --format openai: the response body shape.",
        ),
        click.option(
            "--errors",
            type=click.Path(dir_okay=False, allow_dash=True),
            help="With --format openai: where error lines go [default: OUTPUT_errors.jsonl].",
        ),
        click.option(
            "--with-input", is_flag=True, help="With csv/parquet: add the input row's columns."
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def output_format(
    output: str, fmt: str | None, endpoint: str, errors: str | None, with_input: bool
) -> OutputFormat:
    """The format to write ``output`` in: ``fmt`` if given, else the one its suffix names
    (JSONL lines for stdout and other suffixes, noting the latter). Exits 1 on options that
    do not fit it, before anything runs."""
    suffix = "" if output == "-" else Path(output).suffix.lower()
    kind = fmt or SUFFIX_FORMATS.get(suffix, "mlxq")
    if fmt is None and kind == "mlxq" and suffix not in JSONL_SUFFIXES:
        click.echo(
            f"note: writing JSONL lines to {output} ({suffix!r} names no format; "
            "name it .jsonl, .csv or .parquet, or pass --format)",
            err=True,
        )
    if with_input and kind not in TABLE_FORMATS:
        fail("--with-input applies to --format csv or parquet (or an output named .csv/.parquet)")
    if errors and kind != "openai":
        fail("--errors applies to --format openai")
    if kind == "parquet" and output == "-":
        fail("--format parquet needs a file: give -o FILE.parquet")
    return OutputFormat(kind, endpoint, errors, with_input)


def write_output(conn: redis.Redis, batch_id: str, output: str, fmt: OutputFormat) -> None:
    """Write the batch's results in ``fmt`` (lines or a table), in input order; fails if
    some requests are not done."""
    if fmt.kind in TABLE_FORMATS:
        emit_table(conn, batch_id, output, fmt.kind, fmt.with_input)
    else:
        emit_results(conn, batch_id, output, fmt)


def errors_at(output: str, fmt: OutputFormat) -> str:
    """Where failed requests' lines are written."""
    return (fmt.errors or _errors_path(output)) if fmt.kind == "openai" else output


# -- the results and status commands -----------------------------------------------------
@click.command()
@click.argument("batch_id")
@click.option(
    "-o",
    "--output",
    default="-",
    type=click.Path(dir_okay=False, allow_dash=True),
    show_default=True,
    help=OUTPUT_HELP,
)
@output_options
@click.option("--wait", is_flag=True, help="Wait for the batch to finish, with a progress bar.")
@click.option("--timeout", type=float, help="With --wait: give up after this many seconds.")
@redis_option
def results(
    batch_id: str,
    output: str,
    fmt: str | None,
    endpoint: str,
    errors: str | None,
    with_input: bool,
    wait: bool,
    timeout: float | None,
    redis_url: str,
) -> None:
    """Write a batch's results in input order: a line per request (a table row per request,
    or per sample of requests with n)."""
    out_fmt = output_format(output, fmt, endpoint, errors, with_input)
    conn = connect(redis_url)
    with redis_errors(redis_url):
        try:
            waited = wait_with_progress(conn, batch_id, timeout) if wait else None
            write_output(conn, batch_id, output, out_fmt)
        except batches.BatchNotFound as e:
            fail(str(e))
        if waited is not None:
            fail_on_failures(conn, waited, errors_at(output, out_fmt))
