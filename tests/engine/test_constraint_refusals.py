"""Structured outputs refused, never ignored: a constraint that cannot be enforced is
explained, refused by line at submit (the whole file unless ``--skip-invalid``) and by the
Python client, and a job that reaches a worker with one fails alone."""

from __future__ import annotations

import json
import os
import re

import pytest
from test_constraints import LARK, PERSON, REGEX, SCHEMA

from mlxq.engine.constraints.grammar import constraint_problem
from mlxq.formats.inputs import parse_lines
from mlxq.wire import (
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    RegexFormat,
    Request,
    TextFormat,
)
from tests.helpers import run_mlxq, waiting


def test_constraints_that_cannot_be_enforced_are_explained():
    def problem(fmt) -> str:
        msg = constraint_problem(fmt)
        assert msg is not None
        return msg

    unique = JsonSchemaFormat(JsonSchemaSpec(schema={"type": "array", "uniqueItems": True}))
    assert "uniqueItems" in problem(unique) and problem(unique).startswith(
        "response_format.json_schema.schema: cannot be enforced"
    )
    assert "strin" in problem(JsonSchemaFormat(JsonSchemaSpec(schema={"type": "strin"})))
    assert "unclosed" in problem(RegexFormat("[a-"))
    assert "foo" in problem(GrammarFormat("start: foo"))
    for ok in (SCHEMA, JsonObjectFormat(), RegexFormat(REGEX), GrammarFormat(LARK), TextFormat()):
        assert constraint_problem(ok) is None


def test_lines_with_bad_constraints_are_refused_by_line():
    person = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "response_format": person}
    lines = [
        json.dumps({"prompt": "a", "response_format": person}),
        json.dumps({"prompt": "b", "response_format": {"type": "regex", "pattern": "(x"}}),
        json.dumps(
            {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat}
        ),
        json.dumps(
            {
                "custom_id": "d",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {**chat, "response_format": {"type": "json_schema", "json_schema": {}}},
            }
        ),
        json.dumps({"prompt": "e", "response_format": {"type": "text"}}),
        json.dumps({"prompt": "f", "response_format": {"type": "yaml"}}),
    ]
    parsed = parse_lines(lines)
    assert [e.line for e in parsed.errors] == [2, 4, 6]
    msgs = [e.message for e in parsed.errors]
    assert msgs[0].startswith("response_format.pattern: cannot be enforced")
    assert msgs[1].startswith("body.response_format.json_schema: missing")
    assert msgs[2].startswith("response_format.type: Invalid value 'yaml'")
    assert [r.custom_id for r in parsed.requests] == ["line-1", "c", "line-5"]
    assert parsed.requests[1].response_format.json_schema.schema == PERSON


def test_submit_refuses_a_file_with_a_broken_schema(valkey_url, conn, tmp_path):
    broken = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    src = tmp_path / "schemas.jsonl"
    src.write_text(
        json.dumps({"prompt": "ok", "response_format": {"type": "json_object"}})
        + "\n"
        + json.dumps({"prompt": "bad", "response_format": broken})
        + "\n"
    )
    env = {**os.environ, "MLXQ_REDIS_URL": valkey_url}
    sub = run_mlxq("submit", str(src), "--queue", "schemas", env=env)
    assert sub.returncode != 0
    assert f"{src}:2: response_format.json_schema.schema: cannot be enforced" in sub.stderr
    assert "Invalid type: strin" in sub.stderr and "Traceback" not in sub.stderr
    assert waiting(conn, "schemas") == 0
    ok = run_mlxq("submit", str(src), "--queue", "schemas", "--skip-invalid", env=env)
    assert ok.returncode == 0, ok.stderr
    assert waiting(conn, "schemas") == 1


def test_the_python_client_refuses_a_constraint_it_cannot_enforce(valkey_url, conn):
    from mlxq.client import Client

    client = Client(valkey_url)
    bad = {"prompt": "x", "response_format": {"type": "grammar", "lark": "start: nothing"}}
    with pytest.raises(ValueError, match=r"request 1: response_format.lark: cannot be enforced"):
        client.submit([{"prompt": "fine"}, bad], queue="client-constraints")
    with pytest.raises(ValueError, match="cannot be enforced"):
        client.submit([Request(prompt="x", response_format=RegexFormat("[z-a]"))], queue="c")
    assert waiting(conn, "client-constraints") == 0
    client.submit([{"prompt": "ok", "response_format": {"type": "json_object"}}], queue="c")
    assert waiting(conn, "c") == 1


def test_a_worker_fails_a_job_with_a_bad_constraint_alone(conn, tiny_model):
    """Jobs enqueued without the submit-time check (another producer) reach a real worker."""
    from mlxq.broker.batches import iter_batch_results, submit
    from mlxq.worker.launch import run_worker
    from mlxq.worker.profile import WorkerProfile

    schema = JsonSchemaFormat(JsonSchemaSpec(schema={"type": "array", "uniqueItems": True}))
    requests = [
        Request(prompt="a", max_tokens=40, response_format=RegexFormat(REGEX), custom_id="ok"),
        Request(prompt="b", max_tokens=8, response_format=schema, custom_id="bad"),
        Request(prompt="c", max_tokens=8, custom_id="free"),
    ]
    batch = submit(conn, requests, queue="vetting")
    run_worker(WorkerProfile(model=tiny_model, max_batch=4), conn, burst=True, queues=["vetting"])
    results = {r.custom_id: r for r in iter_batch_results(conn, batch.batch_id)}
    assert results["bad"].finish_reason == "error" and "uniqueItems" in results["bad"].error
    assert results["ok"].finish_reason == "stop" and re.fullmatch(REGEX, results["ok"].text)
    assert results["free"].error is None
