"""Tables in: every row of a CSV, TSV, Parquet or JSONL table becomes one request.

The prompt is a template filled from the row's columns (``"Q: {question}"``, Python's
format syntax, where a field names a whole column: ``{first name}`` and ``{a.b}`` are the
columns so called, never attribute look-ups). With a system message (or ``chat``), the
filled template is the user message of a chat request instead. ``id_column`` gives each
request its ``custom_id`` (``row-N`` otherwise). The row itself is kept in the request's
``metadata["input"]``, so ``mlxq results --with-input`` can join it back to the result.

Rows are numbered from 1, the header not counted (for JSONL tables, the line number). A
template field naming a column the file does not have refuses the file; a row without a
value for it (a short CSV row, a Parquet null, a JSON object without the key) is an error
that names the row. CSV and TSV (``.tsv``: tab-separated) are read with the standard
library (UTF-8, an optional BOM);
Parquet needs pyarrow (the ``parquet`` extra: ``pip install -e '.[parquet]'``).
"""

from __future__ import annotations

import csv
import datetime
import decimal
import errno
import os
import string
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from mlxq.errors import needs_extra
from mlxq.formats.defaults import RequestDefaults
from mlxq.formats.input_errors import (
    InvalidLine,
    LineError,
    decode_json,
    explain,
    json_kind,
    show,
)
from mlxq.formats.inputs import InputFileError, ParsedInput, checked, read_requests
from mlxq.wire import Message, Request

PARQUET = "reading and writing Parquet"  # what needs the `parquet` extra
TABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".pq")


class TableFileError(InputFileError):
    """A table that cannot be submitted as it is; errors name rows, not lines."""

    def place(self, line: int) -> str:
        return f"{self.path} row {line}"


@dataclass(frozen=True)
class InputOptions:
    """How an input file becomes requests: a table's template and id column, and the
    request defaults that apply to every request (JSONL request files included)."""

    template: str | None = None
    id_column: str | None = None
    chat: bool = False
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    # Every line runs on the batch's model whatever model it names: OpenAI files written
    # for another service name models (gpt-4o-mini) that no mlxq worker serves.
    ignore_line_models: bool = False

    def is_table(self, path: str) -> bool:
        """Whether ``path`` is read as a table (CSV/Parquet, or JSONL with a template)."""
        return Path(path).suffix.lower() in TABLE_SUFFIXES or self.template is not None


def read_input(path: str, options: InputOptions, *, skip_invalid: bool = False) -> ParsedInput:
    """The requests of ``path``: a table (see the module doc) or a JSONL request file."""
    if not options.is_table(path):
        if options.id_column is not None:
            raise InputFileError(
                path, [], "--id-column applies to tables (CSV, Parquet, or JSONL with --template)"
            )
        parsed = read_requests(path, skip_invalid=skip_invalid, defaults=options.defaults)
    else:
        columns, rows = _open_table(path)
        parsed = _table_requests(path, columns, rows, options, skip_invalid)
    if options.ignore_line_models:
        parsed.requests = [msgspec.structs.replace(r, model=None) for r in parsed.requests]
    return parsed


def error_place(path: str, options: InputOptions | None, line: int) -> str:
    """Where an error of ``path`` is: ``FILE row N`` for tables, ``FILE:LINE`` otherwise."""
    if options is not None and options.is_table(path):
        return TableFileError(path, []).place(line)
    return InputFileError(path, []).place(line)


# -- reading rows ------------------------------------------------------------------------
Rows = Iterator[tuple[int, dict[str, Any] | LineError]]


def _open_table(path: str) -> tuple[list[str] | None, Rows]:
    """The table's column names (None when rows may differ: JSONL) and its numbered rows."""
    if path == "-":
        raise TableFileError(path, [], "a table is read from a file, not stdin: give its path")
    suffix = Path(path).suffix.lower()
    if suffix in (".csv", ".tsv"):
        return _csv_rows(path, "\t" if suffix == ".tsv" else ",")
    if suffix in (".parquet", ".pq"):
        if not Path(path).exists():  # before asking for the extra that reads it
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return _parquet_rows(path)
    return None, _jsonl_rows(path)


def _csv_rows(path: str, delimiter: str = ",") -> tuple[list[str], Rows]:
    f = Path(path).open(newline="", encoding="utf-8-sig")
    reader = csv.reader(f, delimiter=delimiter)
    header = next(reader, None)
    if header is None:
        f.close()
        kind = "TSV" if delimiter == "\t" else "CSV"
        raise TableFileError(path, [], f"no rows in {path} (a {kind} table starts with a header)")
    twice = sorted({c for c in header if header.count(c) > 1})
    if twice:
        f.close()
        names = ", ".join(repr(c) for c in twice)
        raise TableFileError(path, [], f"the header names {names} more than once; rename them")

    def rows() -> Rows:
        with f:
            try:
                yield from numbered(reader)
            except UnicodeDecodeError as e:
                raise TableFileError(path, [], f"{path} is not UTF-8 text ({e})") from e

    def numbered(reader: Any) -> Rows:
        for n, cells in enumerate(reader, 1):
            if not cells:
                continue  # a blank line
            if len(cells) > len(header):
                yield (
                    n,
                    LineError(
                        n, f"{len(cells)} fields, but the header names {len(header)} columns"
                    ),
                )
                continue
            # A short row has no value for its last columns (not an empty string).
            yield n, dict(zip(header, cells, strict=False))

    return header, rows()


def _parquet_rows(path: str) -> tuple[list[str], Rows]:
    with needs_extra("parquet", PARQUET):
        import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise TableFileError(path, [], f"cannot read {path} as Parquet: {e}") from e
    names = list(pf.schema_arrow.names)

    def rows() -> Rows:
        n = 0
        for batch in pf.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                n += 1
                yield n, {k: v for k, v in row.items() if v is not None}

    return names, rows()


def _jsonl_rows(path: str) -> Rows:
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = decode_json(raw, n)
            except InvalidLine as e:
                yield n, e.error
                continue
            if isinstance(obj, dict):
                yield n, {k: v for k, v in obj.items() if v is not None}
            else:
                yield n, LineError(n, f"expected a JSON object (a row), got {json_kind(obj)}")


# -- rows to requests --------------------------------------------------------------------
class _ColumnFormatter(string.Formatter):
    """str.format where a field is a whole column name: no attribute or index look-ups."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        return self.get_value(field_name, args, kwargs), field_name


_formatter = _ColumnFormatter()


def template_columns(template: str) -> list[str]:
    """The columns a template names, in order of first use; ``ValueError`` if it is bad."""
    names: list[str] = []
    for _text, name, spec, _conv in _formatter.parse(template):
        if name is None:
            continue
        if name == "" or name.isdigit():
            raise ValueError("template fields must name a column, like {question} (not {} or {0})")
        if spec and "{" in spec:
            raise ValueError(f"template field {{{name}}}: nested fields are not supported")
        if name not in names:
            names.append(name)
    return names


def _table_requests(
    path: str, columns: list[str] | None, rows: Rows, options: InputOptions, skip_invalid: bool
) -> ParsedInput:
    template = _template_for(path, columns, options)
    try:
        needed = template_columns(template)
    except ValueError as e:
        raise TableFileError(path, [], f"--template: {e}") from e
    wanted = [*needed, *([options.id_column] if options.id_column else [])]
    absent = [c for c in wanted if columns is not None and c not in columns]
    if absent:
        raise TableFileError(path, [], _absent_message(path, absent, columns or []))
    out = ParsedInput()
    seen: dict[str, int] = {}
    for n, row in rows:
        try:
            if isinstance(row, LineError):
                raise InvalidLine(n, row.message)
            req = _row_request(n, row, template, wanted, options)
            first = seen.setdefault(req.custom_id or "", n)
            if first != n:
                raise InvalidLine(
                    n, f"custom_id {show(req.custom_id)} is already used by row {first}"
                )
        except InvalidLine as e:
            out.errors.append(e.error)
            continue
        out.requests.append(req)
        out.lines.append(n)
    return checked(out, path, skip_invalid, TableFileError, "rows")


def _template_for(path: str, columns: list[str] | None, options: InputOptions) -> str:
    if options.template is not None:
        return options.template
    if columns is not None and "prompt" in columns:
        return "{prompt}"
    listed = f" (columns: {', '.join(columns)})" if columns else ""
    raise TableFileError(
        path,
        [],
        f"give --template to say how a row becomes a prompt, e.g. --template "
        f"'Q: {{question}}'{listed}",
    )


def _absent_message(path: str, absent: list[str], columns: list[str]) -> str:
    names = ", ".join(repr(c) for c in absent)
    return (
        f"{path} has no column {names}, which --template/--id-column use; "
        f"its columns are: {', '.join(columns) or '(none)'}"
    )


def _row_request(
    n: int, row: Mapping[str, Any], template: str, wanted: list[str], options: InputOptions
) -> Request:
    missing = [c for c in wanted if c not in row]
    if missing:
        raise InvalidLine(n, f"no value for column {', '.join(repr(c) for c in missing)}")
    try:
        text = _formatter.vformat(template, (), row)
    except (ValueError, TypeError) as e:
        raise InvalidLine(n, f"--template cannot be filled from this row: {e}") from e
    if not text:
        raise InvalidLine(n, "the filled template is empty: the prompt would be empty")
    cid = f"row-{n}" if options.id_column is None else str(row[options.id_column])
    if not cid:
        raise InvalidLine(n, f"column {options.id_column!r} is empty: every row needs an id")
    system = options.defaults.system
    if system is not None or options.chat:
        pre = [Message("system", system)] if system is not None else []
        req = Request(messages=[*pre, Message("user", text)])
    else:
        req = Request(prompt=text)
    fields = {**options.defaults.fields, "custom_id": cid, "metadata": {"input": _jsonable(row)}}
    data = {**msgspec.to_builtins(req), **fields}
    try:
        return msgspec.convert(data, Request)
    except msgspec.ValidationError as e:
        raise InvalidLine(n, explain(e, data)) from e


def _jsonable(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row as JSON values (Parquet's dates, decimals and bytes as text)."""
    return {k: _json_value(v) for k, v in row.items()}


def _json_value(v: Any) -> Any:
    if isinstance(v, str | int | float | bool) or v is None:
        return v
    if isinstance(v, datetime.date | datetime.time):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return str(v)
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_json_value(x) for x in v]
    return str(v)
