"""Tables out: a batch's results as CSV (standard library) or Parquet (pyarrow).

One row per request, in input order, with :data:`RESULT_COLUMNS`; a request with ``n`` > 1
samples gives one row per choice, and the table then has a ``choice`` column after
``custom_id`` (the sample's index; 0 for requests of one sample): each choice row has its
own text, finish_reason and completion_tokens, and the request's prompt_tokens (so
``total_tokens`` is the prompt's plus the choice's). ``with_input`` adds the
columns of the input row each request came from: a table input keeps its row in the
request's ``metadata["input"]``; for a JSONL request file the request's own ``metadata``
fields are its input columns. An input column whose name is taken by a result column is
written as ``input_NAME``. Columns come in the order first seen, so the first row need not
have them all.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from typing import IO, Any

from mlxq.errors import needs_extra
from mlxq.formats.tables import PARQUET
from mlxq.wire import Result

TABLE_FORMATS = ("csv", "parquet")

RESULT_COLUMNS = (
    "custom_id",
    "text",
    "finish_reason",
    "error",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "queue_wait_s",
    "ttft_s",
    "generation_s",
    "prefill_tps",
    "decode_tps",
    "enqueued_at",
    "started_at",
    "finished_at",
    "worker",
    "model",
    "job_id",
)


def input_row(result: Result) -> dict[str, Any] | None:
    """The input columns of a result's request, or None when it has none stored (a job
    that never ran has no result body to carry them)."""
    meta = result.metadata or {}
    kept = meta.get("input")
    if isinstance(kept, dict):
        return kept
    return dict(meta) if meta else None


def result_row(result: Result) -> dict[str, Any]:
    """The :data:`RESULT_COLUMNS` of one result."""
    t, u = result.timing, result.usage
    generation = None
    if t.started_at is not None and t.finished_at is not None:
        generation = max(0.0, t.finished_at - t.started_at)
    return {
        "custom_id": result.custom_id,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "error": result.error,
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "queue_wait_s": t.queue_wait_s,
        "ttft_s": t.ttft_s,
        "generation_s": generation,
        "prefill_tps": t.prefill_tps,
        "decode_tps": t.decode_tps,
        "enqueued_at": t.enqueued_at,
        "started_at": t.started_at,
        "finished_at": t.finished_at,
        "worker": result.worker,
        "model": result.model,
        "job_id": result.job_id,
    }


def choice_rows(result: Result) -> list[dict[str, Any]]:
    """The rows of one result: one per choice (with ``choice``), else its one row."""
    row = result_row(result)
    if not result.choices:
        return [row]
    out = []
    for c in result.choices:
        prompt = result.usage.prompt_tokens
        own = {"text": c.text, "finish_reason": c.finish_reason}
        tokens = {"completion_tokens": len(c.token_ids), "total_tokens": prompt + len(c.token_ids)}
        out.append({**row, "choice": c.index, **own, **tokens})
    return out


def table_rows(results: Iterable[Result], with_input: bool) -> tuple[list[str], list[dict]]:
    """The column names and the rows of ``results`` (input columns after the result's)."""
    results = list(results)
    columns = list(RESULT_COLUMNS)
    sampled = any(r.choices for r in results)
    if sampled:
        columns.insert(1, "choice")
    taken = (*RESULT_COLUMNS, "choice") if sampled else RESULT_COLUMNS
    rows = []
    for result in results:
        inputs = input_row(result) if with_input else None
        for row in choice_rows(result):
            if sampled:
                row.setdefault("choice", 0)
            for name, value in (inputs or {}).items():
                key = f"input_{name}" if name in taken else str(name)
                if key not in columns:
                    columns.append(key)
                row[key] = value
            rows.append(row)
    return columns, rows


def rows_without_input(results: Iterable[Result]) -> int:
    """How many results carry no input columns."""
    return sum(1 for r in results if input_row(r) is None)


def write_csv(out: IO[str], columns: list[str], rows: Iterable[dict]) -> None:
    """CSV with a header; None is an empty cell, lists and objects are JSON."""
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="raise", lineterminator="\r\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_cell(v) for k, v in row.items()})


def _csv_cell(v: Any) -> Any:
    if isinstance(v, dict | list):
        import json

        return json.dumps(v, ensure_ascii=False)
    return v


def write_parquet(path: str, columns: list[str], rows: list[dict]) -> None:
    """A Parquet file; a column whose values mix types is written as text."""
    with needs_extra("parquet", PARQUET):
        import pyarrow as pa
        import pyarrow.parquet as pq
    arrays = {}
    for name in columns:
        values = [row.get(name) for row in rows]
        try:
            arrays[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arrays[name] = pa.array([None if v is None else str(v) for v in values], pa.string())
    if not rows:  # no values to infer from: say what each result column is
        arrays = {name: pa.array([], pa.string()) for name in columns}
    pq.write_table(pa.table(arrays), path)
