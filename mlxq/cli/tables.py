"""Table options of ``mlxq submit``/``mlxq run`` (template, id column, request defaults) and
the CSV/Parquet writer behind ``mlxq results --format csv|parquet``."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import redis

from mlxq.broker import batches
from mlxq.cli.support import fail
from mlxq.formats.defaults import DEFAULTABLE, RequestDefaults
from mlxq.formats.tables import InputOptions
from mlxq.wire import MAX_LOGPROBS, MAX_SAMPLES, MAX_TOKENS_LIMIT

_DEFAULT_OPTIONS = [
    click.option(
        "--max-tokens",
        type=click.IntRange(1, MAX_TOKENS_LIMIT),
        help="Most tokens to generate, for requests that do not set it.",
    ),
    click.option(
        "--temperature",
        "--temp",  # mlx_lm's name for it
        type=click.FloatRange(0, 10),
        help="Sampling temperature (0: greedy), for requests that do not set it.",
    ),
    click.option(
        "--top-p",
        type=click.FloatRange(0, 1),
        help="Nucleus sampling, for requests that do not set it.",
    ),
    click.option(
        "--top-k", type=click.IntRange(0), help="Top-k sampling, for requests that do not set it."
    ),
    click.option(
        "--min-p",
        type=click.FloatRange(0, 1),
        help="Min-p sampling, for requests that do not set it.",
    ),
    click.option(
        "--repetition-penalty",
        type=click.FloatRange(0, 10, min_open=True),
        help="Repetition penalty, for requests that do not set it.",
    ),
    click.option(
        "--seed",
        type=click.IntRange(0, 2**32 - 1),
        help="Sampling seed, for requests that do not set it.",
    ),
    click.option(
        "--stop", multiple=True, help="Stop string (repeatable), for requests that set no `stop`."
    ),
    click.option(
        "--logprobs",
        type=click.IntRange(0, MAX_LOGPROBS),
        help="Top-n logprobs per token, for requests that do not set it.",
    ),
    click.option(
        "--n",
        "n",
        type=click.IntRange(1, MAX_SAMPLES),
        help="Samples per request (prompt prefilled once), for requests that do not set it.",
    ),
    click.option(
        "--json-schema",
        type=click.Path(exists=True, dir_okay=False),
        help="Outputs must be JSON valid under this schema (a .json file), for requests "
        "that set no response_format.",
    ),
    click.option(
        "--response-format",
        help='A response_format object as JSON, e.g. \'{"type": "regex", "pattern": '
        '"[0-9]+"}\', for requests that set none.',
    ),
]


def input_options(f: Callable) -> Callable:
    """Add the table and request-default options; the command gets ``inputs: InputOptions``."""
    options = [
        click.option(
            "--template",
            help="Prompt template filled from each row's columns, e.g. 'Q: {question}' "
            "(reads a JSONL file as a table of rows) [default: the 'prompt' column].",
        ),
        click.option("--id-column", help="Table column that gives each row's custom_id."),
        click.option(
            "--system",
            help="System message: table rows become chat requests (system + the filled "
            "template as user message); JSONL chat lines without one get it.",
        ),
        click.option(
            "--chat", is_flag=True, help="Table rows become chat requests (user message)."
        ),
        click.option(
            "--ignore-line-models",
            is_flag=True,
            help="Run every line on --model (or the queue's workers), whatever model it "
            "names: for OpenAI files written for another service (body.model: gpt-4o-mini).",
        ),
        *_DEFAULT_OPTIONS,
    ]

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {k: kwargs.pop(k) for k in DEFAULTABLE}
        fields = {k: v for k, v in given.items() if v is not None and v != ()}
        if "stop" in fields:
            fields["stop"] = list(fields["stop"])
        response_format = _response_format(kwargs.pop("json_schema"), fields)
        if response_format is not None:
            fields["response_format"] = response_format
        try:
            defaults = RequestDefaults(fields, kwargs.pop("system"))
        except ValueError as e:
            raise click.UsageError(str(e)) from e
        kwargs["inputs"] = InputOptions(
            template=kwargs.pop("template"),
            id_column=kwargs.pop("id_column"),
            chat=kwargs.pop("chat"),
            defaults=defaults,
            ignore_line_models=kwargs.pop("ignore_line_models"),
        )
        return f(*args, **kwargs)

    return functools.reduce(lambda acc, opt: opt(acc), reversed(options), wrapper)


def _response_format(schema_file: str | None, fields: dict[str, Any]) -> Any:
    """The ``response_format`` default from ``--json-schema FILE`` or ``--response-format``."""
    text = fields.pop("response_format", None)
    if schema_file is not None and text is not None:
        raise click.UsageError("give --json-schema or --response-format, not both")
    if schema_file is not None:
        what, raw = "--json-schema", Path(schema_file).read_text(encoding="utf-8")
    else:
        what, raw = "--response-format", text
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise click.UsageError(f"{what}: not valid JSON ({e})") from e
    if schema_file is None:
        return value
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in Path(schema_file).stem)
    return {"type": "json_schema", "json_schema": {"name": name[:64] or "schema", "schema": value}}


def emit_table(conn: redis.Redis, batch_id: str, output: str, fmt: str, with_input: bool) -> None:
    """Write a batch's results as a CSV or Parquet table (``-`` is stdout, CSV only)."""
    from mlxq.formats import table_output as t

    if fmt == "parquet" and output == "-":
        fail("--format parquet needs a file: give -o FILE.parquet")
    results = list(batches.iter_batch_results(conn, batch_id))
    done = [r for r in results if r is not None]
    columns, rows = t.table_rows(done, with_input)
    if output != "-":
        Path(output).parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        t.write_parquet(output, columns, rows)
    else:
        with click.open_file(output, "w", encoding="utf-8") as out:
            t.write_csv(out, columns, rows)
    if output != "-":
        click.echo(f"wrote {len(rows)} rows to {output}", err=True)
    lacking = t.rows_without_input(done) if with_input else 0
    if lacking:
        click.echo(
            f"note: {lacking} rows have no stored input (jobs that never ran keep none); "
            "their input columns are empty",
            err=True,
        )
    missing = len(results) - len(done)
    if missing:
        fail(
            f"{missing} of {len(results)} requests are not done yet; "
            "rerun with --wait to wait for them"
        )
