"""``mlxq run -o FILE`` writes the format FILE's suffix names (CSV, Parquet, JSONL lines),
``--format`` overrides it (``openai``: OpenAI Batch output lines and an errors file), with
the same writers as ``mlxq results``; an unknown suffix gets JSONL lines and a note."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from helpers import run_mlxq

from mlxq.formats.table_output import RESULT_COLUMNS

ENV = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}  # an embedded Valkey
IDS = ["first", "second", "third"]


def _inputs(tmp_path: Path, failing: bool = False) -> Path:
    src = tmp_path / "in.jsonl"
    lines = [{"custom_id": c, "prompt": f"Say {c}", "max_tokens": 3} for c in IDS]
    if failing:  # max_tokens alone over the tiny model's context: fails alone
        lines[1]["max_tokens"] = 5000
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return src


def _run(tmp_path: Path, model: str, output: Path, *args: str, failing: bool = False):
    src = _inputs(tmp_path, failing)
    return run_mlxq("run", str(src), "--model", model, "-o", str(output), *args, env=ENV)


def _csv_ids(path: Path) -> list[str]:
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(RESULT_COLUMNS)
    return [row[0] for row in rows[1:]]


def _parquet_ids(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path).column("custom_id").to_pylist()


def _jsonl_ids(path: Path) -> list[str]:
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    ("name", "read"),
    [("out.csv", _csv_ids), ("out.parquet", _parquet_ids), ("out.jsonl", _jsonl_ids)],
)
def test_the_output_suffix_picks_the_format(tmp_path, tiny_model, name, read):
    out = tmp_path / name
    run = _run(tmp_path, tiny_model, out)
    assert run.returncode == 0, run.stderr
    assert read(out) == IDS  # every request once, in input order
    assert "note:" not in run.stderr


def test_format_openai_writes_output_lines_and_an_errors_file(tmp_path, tiny_model):
    out = tmp_path / "answers.jsonl"
    openai = ("--format", "openai", "--endpoint", "/v1/completions")
    run = _run(tmp_path, tiny_model, out, *openai, failing=True)
    errors = tmp_path / "answers_errors.jsonl"
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith(f"(error lines in {errors})")
    good = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["custom_id"] for g in good] == ["first", "third"]
    assert all(g["response"]["body"]["object"] == "text_completion" for g in good)
    (bad,) = [json.loads(line) for line in errors.read_text().splitlines()]
    assert bad["custom_id"] == "second" and bad["response"] is None
    assert "max_tokens" in bad["error"]["message"]


def test_format_overrides_the_suffix_and_an_unknown_suffix_gets_jsonl_and_a_note(
    tmp_path, tiny_model
):
    as_csv = tmp_path / "out.jsonl"
    run = _run(tmp_path, tiny_model, as_csv, "--format", "csv")
    assert run.returncode == 0, run.stderr
    assert _csv_ids(as_csv) == IDS
    txt = tmp_path / "out.txt"
    run = _run(tmp_path, tiny_model, txt)
    assert run.returncode == 0, run.stderr
    assert f"note: writing JSONL lines to {txt} ('.txt' names no format;" in run.stderr
    assert _jsonl_ids(txt) == IDS


def test_options_that_do_not_fit_the_format_are_refused_before_the_model_loads(
    tmp_path, tiny_model
):
    for args, says in [
        (("-o", str(tmp_path / "o.jsonl"), "--with-input"), "--with-input applies to"),
        (("-o", str(tmp_path / "o.csv"), "--errors", "e.jsonl"), "--errors applies to"),
        (("-o", "-", "--format", "parquet"), "--format parquet needs a file"),
    ]:
        src = _inputs(tmp_path)
        run = run_mlxq("run", str(src), "--model", tiny_model, *args, env=ENV)
        assert run.returncode == 1 and says in run.stderr, run.stderr
        assert "loading" not in run.stderr


def test_mlxq_results_reads_the_suffix_too(tmp_path, tiny_model, valkey_url):
    run = _run(tmp_path, tiny_model, tmp_path / "out.jsonl", "--redis-url", valkey_url, "--json")
    assert run.returncode == 0, run.stderr
    batch_id = json.loads(run.stdout)["batch_id"]
    table = tmp_path / "again.parquet"
    res = run_mlxq("results", batch_id, "-o", str(table), url=valkey_url)
    assert res.returncode == 0, res.stderr
    assert _parquet_ids(table) == IDS
