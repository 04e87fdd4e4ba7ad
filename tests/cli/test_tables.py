"""Tables in and out: CSV/Parquet/JSONL rows become requests; results come back as tables."""

from __future__ import annotations

import csv
import datetime
import io
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from helpers import ROOT, run_mlxq

from mlxq.broker import batches, keys
from mlxq.formats.defaults import RequestDefaults
from mlxq.formats.inputs import InputFileError
from mlxq.formats.table_output import RESULT_COLUMNS
from mlxq.formats.tables import InputOptions, TableFileError, read_input
from mlxq.wire import Message, Request

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

QUESTIONS = [("q1", "What is 2+2?", "math"), ("q2", "Capital of France, in one word?", "geo")]


def write_csv(path: Path, rows: list[tuple], header=("qid", "question", "topic")) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


@pytest.fixture
def questions_csv(tmp_path: Path) -> Path:
    return write_csv(tmp_path / "data.csv", QUESTIONS)


# -- tables in -----------------------------------------------------------------------------
def test_csv_rows_become_prompts_with_ids_defaults_and_the_row_kept(questions_csv):
    opts = InputOptions(
        template="Q: {question}\nA:",
        id_column="qid",
        defaults=RequestDefaults({"max_tokens": 12, "temperature": 0.5, "stop": ["\n"]}),
    )
    parsed = read_input(str(questions_csv), opts)
    assert [r.custom_id for r in parsed.requests] == ["q1", "q2"]
    first = parsed.requests[0]
    assert first.prompt == "Q: What is 2+2?\nA:" and first.messages is None
    assert (first.max_tokens, first.temperature, first.stop) == (12, 0.5, ["\n"])
    assert first.metadata == {"input": {"qid": "q1", "question": "What is 2+2?", "topic": "math"}}
    assert parsed.lines == [1, 2]


def test_system_makes_chat_requests_and_chat_alone_a_user_message(questions_csv):
    sys_opts = InputOptions(template="{question}", defaults=RequestDefaults(system="Be brief."))
    req = read_input(str(questions_csv), sys_opts).requests[1]
    assert req.prompt is None
    assert req.messages == [
        Message("system", "Be brief."),
        Message("user", "Capital of France, in one word?"),
    ]
    assert req.custom_id == "row-2"  # no --id-column
    chat = read_input(str(questions_csv), InputOptions(template="{question}", chat=True))
    assert chat.requests[0].messages == [Message("user", "What is 2+2?")]


def test_a_column_the_template_names_must_exist(questions_csv):
    with pytest.raises(TableFileError) as e:
        read_input(str(questions_csv), InputOptions(template="Q: {questoin} ({topic})"))
    assert "no column 'questoin'" in str(e.value) and "qid, question, topic" in str(e.value)
    with pytest.raises(TableFileError, match="no column 'id'"):
        read_input(str(questions_csv), InputOptions(template="{question}", id_column="id"))


def test_rows_without_a_value_are_refused_by_row_number(tmp_path):
    src = tmp_path / "short.csv"
    src.write_text("qid,question,topic\nq1,fine,a\nq2\nq3,x,y,extra\nq1,again,b\n")
    with pytest.raises(TableFileError) as e:
        read_input(str(src), InputOptions(template="{question} {topic}", id_column="qid"))
    report = str(e.value).splitlines()
    assert report == [
        f"{src} row 2: no value for column 'question', 'topic'",
        f"{src} row 3: 4 fields, but the header names 3 columns",
        f'{src} row 4: custom_id "q1" is already used by row 1',
    ]
    kept = read_input(str(src), InputOptions(template="{question}"), skip_invalid=True)
    assert [r.prompt for r in kept.requests] == ["fine", "again"]
    assert [err.line for err in kept.errors] == [2, 3]


def test_the_example_table_reads_as_the_readme_says():
    parsed = read_input(
        str(ROOT / "examples" / "questions.csv"),
        InputOptions(template="Q: {question}\nA:", id_column="qid"),
    )
    assert [r.custom_id for r in parsed.requests] == ["q1", "q2", "q3", "q4"]
    assert parsed.requests[2].prompt.startswith("Q: Name a prime number larger than 10, and")
    assert parsed.requests[0].metadata["input"]["topic"] == "geography"


def test_a_header_naming_a_column_twice_is_refused(tmp_path):
    src = write_csv(tmp_path / "twice.csv", [("1", "2", "3")], header=("q", "a", "q"))
    with pytest.raises(TableFileError, match="the header names 'q' more than once"):
        read_input(str(src), InputOptions(template="{a}"))


def test_template_fields_are_whole_column_names_never_lookups(tmp_path):
    src = write_csv(tmp_path / "odd.csv", [("1", "x")], header=("a.b", "first name"))
    req = read_input(str(src), InputOptions(template="{a.b}|{first name!r}|{a.b:>3}")).requests[0]
    assert req.prompt == "1|'x'|  1"
    for bad in ("{}", "{0}"):
        with pytest.raises(TableFileError, match="must name a column"):
            read_input(str(src), InputOptions(template=bad))


def test_a_table_without_template_uses_its_prompt_column_or_says_what_to_do(tmp_path):
    with_prompt = write_csv(tmp_path / "p.csv", [("hello",)], header=("prompt",))
    assert read_input(str(with_prompt), InputOptions()).requests[0].prompt == "hello"
    none = write_csv(tmp_path / "n.csv", [("hello",)], header=("text",))
    with pytest.raises(TableFileError, match=r"give --template .*\(columns: text\)"):
        read_input(str(none), InputOptions())


def test_parquet_rows_keep_their_types_as_json(tmp_path):
    table = pa.table(
        {
            "id": [7, 8],
            "question": ["one?", None],
            "day": [datetime.date(2026, 1, 2), datetime.date(2026, 1, 3)],
            "score": [0.5, 1.5],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    opts = InputOptions(template="{question} on {day}", id_column="id")
    with pytest.raises(TableFileError, match="row 2: no value for column 'question'"):
        read_input(str(tmp_path / "t.parquet"), opts)
    parsed = read_input(str(tmp_path / "t.parquet"), opts, skip_invalid=True)
    (req,) = parsed.requests
    assert req.custom_id == "7" and req.prompt == "one? on 2026-01-02"
    assert req.metadata["input"] == {"id": 7, "question": "one?", "day": "2026-01-02", "score": 0.5}
    msgspec.json.encode(req)  # JSON-safe all through


def test_a_broken_parquet_file_is_refused_with_the_reason(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(TableFileError, match=r"cannot read .* as Parquet"):
        read_input(str(tmp_path / "bad.parquet"), InputOptions(template="{x}"))


def test_jsonl_with_a_template_is_a_table_of_objects(tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text('{"qid": 1, "q": "a"}\n\n{"qid": 2}\n[1]\n')
    with pytest.raises(TableFileError) as e:
        read_input(str(src), InputOptions(template="Q: {q}", id_column="qid"))
    assert str(e.value).splitlines() == [
        f"{src} row 3: no value for column 'q'",
        f"{src} row 4: expected a JSON object (a row), got an array",
    ]


def test_defaults_fill_only_what_a_jsonl_line_leaves_out(tmp_path):
    src = tmp_path / "reqs.jsonl"
    lines = [
        {"prompt": "a", "temperature": 0},
        {"messages": [{"role": "user", "content": "b"}], "max_tokens": 3},
        {"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "c"}]},
        {
            "custom_id": "o1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "d"}],
                "max_completion_tokens": 5,
                "temperature": None,
            },
        },
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    defaults = RequestDefaults({"max_tokens": 40, "temperature": 0.8}, system="S")
    parsed = read_input(str(src), InputOptions(defaults=defaults), skip_invalid=True)
    (err,) = parsed.errors
    assert err.line == 1 and "--system applies to chat requests" in err.message
    b, c, d = parsed.requests
    assert (b.max_tokens, b.temperature) == (3, 0.8)
    assert [m.role for m in b.messages] == ["system", "user"] and b.messages[0].content == "S"
    assert [m.content for m in c.messages] == ["own", "c"]  # already has a system message
    assert (d.max_tokens, d.temperature) == (5, 0.8)  # a null is the same as leaving it out
    no_system = read_input(str(src), InputOptions(defaults=RequestDefaults({"top_k": 5})))
    assert no_system.requests[0].temperature == 0 and no_system.requests[0].top_k == 5


def test_bad_default_values_and_jsonl_id_column_are_refused(tmp_path):
    with pytest.raises(ValueError, match="max_tokens"):
        RequestDefaults({"max_tokens": 0})
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "x"}\n')
    with pytest.raises(InputFileError, match="--id-column applies to tables"):
        read_input(str(src), InputOptions(id_column="qid"))


def test_submit_refuses_a_table_with_a_missing_column_and_enqueues_nothing(
    valkey_url, conn, questions_csv
):
    res = run_mlxq("submit", str(questions_csv), "--template", "{nope}", url=valkey_url)
    assert res.returncode == 1
    assert "no column 'nope'" in res.stderr
    assert "(nothing was enqueued)" in res.stderr and "--skip-invalid" not in res.stderr
    assert conn.zcard(keys.batches()) == 0
    ok = run_mlxq(
        "submit",
        str(questions_csv),
        "--template",
        "Q: {question}",
        "--id-column",
        "qid",
        "--max-tokens",
        "4",
        "--queue",
        "tq",
        "--json",
        url=valkey_url,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["total"] == 2


def test_parquet_without_pyarrow_says_which_extra(tmp_path, questions_csv):
    # The same CLI, in a process where pyarrow cannot be imported.
    code = (
        "import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None\n"
        "from mlxq.cli.main import main\n"
        "main()"
    )
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    res = subprocess.run(
        [sys.executable, "-c", code, "submit", str(tmp_path / "x.parquet"), "--template", "{a}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("mlxq: error: reading and writing Parquet needs the `parquet` extra")
    assert line.endswith("pip install -e '.[parquet]' in your mlxq clone")


# -- tables out ----------------------------------------------------------------------------
@pytest.fixture
def finished_batch(valkey_url, conn, tiny_model, questions_csv, tmp_path) -> tuple[str, list]:
    """A table run through `mlxq run` on the shared Valkey: (batch id, JSONL results)."""
    out = tmp_path / "out.jsonl"
    res = run_mlxq(
        "run",
        str(questions_csv),
        "--model",
        tiny_model,
        "--template",
        "Q: {question}\nA:",
        "--id-column",
        "qid",
        "--max-tokens",
        "6",
        "-o",
        str(out),
        "--redis-url",
        valkey_url,
        "--json",
    )
    assert res.returncode == 0, res.stderr
    batch_id = json.loads(res.stdout.splitlines()[-1])["batch_id"]
    return batch_id, [json.loads(x) for x in out.read_text().splitlines()]


def test_results_as_csv_and_parquet_in_input_order_with_the_input_row(
    valkey_url, finished_batch, tmp_path
):
    batch_id, results = finished_batch
    assert [r["custom_id"] for r in results] == ["q1", "q2"]
    assert all(r["usage"]["completion_tokens"] == 6 for r in results)  # --max-tokens applied

    res = run_mlxq(
        "results", batch_id, "--format", "csv", "--with-input", "-o", "-", url=valkey_url
    )
    assert res.returncode == 0, res.stderr
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert list(rows[0]) == [*RESULT_COLUMNS, "qid", "question", "topic"]
    for row, r, (qid, question, topic) in zip(rows, results, QUESTIONS, strict=True):
        assert (row["custom_id"], row["qid"], row["question"], row["topic"]) == (
            qid,
            qid,
            question,
            topic,
        )
        assert row["text"] == r["text"] and row["finish_reason"] == "length"
        assert int(row["completion_tokens"]) == 6
        assert int(row["prompt_tokens"]) == r["usage"]["prompt_tokens"] > 0
        assert float(row["ttft_s"]) == r["timing"]["ttft_s"]
        assert float(row["generation_s"]) >= 0 and row["error"] == ""

    dest = tmp_path / "sub" / "out.parquet"
    res = run_mlxq(
        "results", batch_id, "--format", "parquet", "-o", str(dest), "--with-input", url=valkey_url
    )
    assert res.returncode == 0 and f"wrote 2 rows to {dest}" in res.stderr
    table = pq.read_table(dest)
    assert table.column("custom_id").to_pylist() == ["q1", "q2"]
    assert table.column("text").to_pylist() == [r["text"] for r in results]
    assert table.column("question").to_pylist() == [q[1] for q in QUESTIONS]
    assert table.schema.field("completion_tokens").type == pa.int64()
    assert table.schema.field("ttft_s").type == pa.float64()

    plain = run_mlxq("results", batch_id, "--format", "csv", url=valkey_url)
    assert next(csv.reader(io.StringIO(plain.stdout))) == list(RESULT_COLUMNS)


def test_table_results_refusals(valkey_url, conn, questions_csv):
    sub = run_mlxq("submit", str(questions_csv), "--queue", "idle", "--json", url=valkey_url)
    assert sub.returncode == 1  # no prompt column, no template
    info = batches.submit(conn, [Request(prompt="x")], queue="idle")
    stdout_parquet = run_mlxq("results", info.batch_id, "--format", "parquet", url=valkey_url)
    assert stdout_parquet.returncode == 1 and "needs a file" in stdout_parquet.stderr
    jsonl_input = run_mlxq("results", info.batch_id, "--with-input", url=valkey_url)
    assert jsonl_input.returncode == 1 and "--format csv or parquet" in jsonl_input.stderr
    pending = run_mlxq("results", info.batch_id, "--format", "csv", url=valkey_url)
    assert pending.returncode == 1 and "1 of 1 requests are not done yet" in pending.stderr
    assert pending.stdout.splitlines() == [",".join(RESULT_COLUMNS)]


def test_table_rows_join_inputs_and_keep_types_honest(tmp_path):
    from mlxq.formats.table_output import table_rows, write_csv, write_parquet
    from mlxq.wire import Result, Timing, Usage

    def result(cid: str, metadata: dict) -> Result:
        return Result(
            job_id=f"j-{cid}",
            custom_id=cid,
            finish_reason="stop",
            text="t",
            usage=Usage(2, 3, 5),
            metadata=metadata,
            timing=Timing(started_at=10.0, finished_at=12.5),
        )

    results = [
        result("a", {"input": {"text": "row text", "n": 1, "tags": ["x", "y"]}}),
        result("b", {"topic": "from a JSONL line's metadata", "n": "two"}),
        result("c", {}),  # never ran: nothing to join
    ]
    columns, rows = table_rows(results, with_input=True)
    assert columns == [*RESULT_COLUMNS, "input_text", "n", "tags", "topic"]
    assert rows[0]["input_text"] == "row text" and rows[0]["text"] == "t"
    assert rows[0]["generation_s"] == 2.5 and rows[1]["topic"].startswith("from a JSONL")
    out = io.StringIO()
    write_csv(out, columns, rows)
    parsed = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert parsed[0]["tags"] == '["x", "y"]' and parsed[2]["n"] == ""
    write_parquet(str(tmp_path / "t.parquet"), columns, rows)
    table = pq.read_table(tmp_path / "t.parquet")
    assert table.column("n").to_pylist() == ["1", "two", None]  # mixed types: text
    assert table.column("prompt_tokens").to_pylist() == [2, 2, 2]


def test_samples_are_a_row_per_choice_with_a_choice_column(tmp_path):
    from mlxq.formats.table_output import table_rows
    from mlxq.wire import Choice, Result, Usage

    one = Result(job_id="j1", custom_id="one", finish_reason="stop", text="a", usage=Usage(2, 1, 3))
    many = Result(
        job_id="j2",
        custom_id="many",
        finish_reason="stop",
        text="b",
        usage=Usage(4, 5, 9),
        metadata={"input": {"choice": "mine"}},
        choices=[Choice(0, "stop", "b", [1, 2]), Choice(1, "length", "c", [3, 4, 5])],
    )
    columns, rows = table_rows([one, many], with_input=True)
    assert columns[:2] == ["custom_id", "choice"] and "input_choice" in columns
    assert [(r["custom_id"], r["choice"], r["text"]) for r in rows] == [
        ("one", 0, "a"),
        ("many", 0, "b"),
        ("many", 1, "c"),
    ]
    assert [r["finish_reason"] for r in rows[1:]] == ["stop", "length"]
    assert [(r["completion_tokens"], r["total_tokens"]) for r in rows[1:]] == [(2, 6), (3, 7)]
    assert rows[2]["input_choice"] == "mine"
    # Without samples the table is as it was: no choice column.
    assert table_rows([one], with_input=False)[0] == list(RESULT_COLUMNS)


def test_n_is_a_default_and_a_field_of_jsonl_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "n": 2}\n')
    parsed = read_input(str(path), InputOptions(defaults=RequestDefaults({"n": 4})))
    assert [r.n for r in parsed.requests] == [4, 2]
    with pytest.raises(InputFileError, match="stream"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "a", "n": 2, "stream": true}\n')
        read_input(str(bad), InputOptions())


def test_csv_cells_with_carriage_returns_and_newlines_read_back_as_one_row_each():
    """Generated text holds bare \r, \n and quotes (random weights produce any byte): each
    result is still one CSV row, as any CSV reader splits them."""
    from mlxq.formats.table_output import write_csv

    texts = ["a\rb", "c\nd", 'e"f', "g\r\nh", "plain"]
    out = io.StringIO(newline="")
    write_csv(out, ["i", "text"], ({"i": i, "text": t} for i, t in enumerate(texts)))
    rows = list(csv.DictReader(io.StringIO(out.getvalue(), newline="")))
    assert [r["text"] for r in rows] == texts
