"""``mlxq api``'s files (and their listing), API keys and upload limits, and the command's
refusals, through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from api_servers import (
    ADMIN_KEY,
    KEY,
    MAX_LINES,
    MAX_UPLOAD,
    MODEL,
    OTHER_KEY,
    api_client,
    chat_line,
    completion_line,
    create,
    jsonl,
    read_jsonl,
    run_tiny_worker,
    upload,
    wait_final,
)
from click.testing import CliRunner

from mlxq.api import redis_keys as rk
from mlxq.cli.api import api_command


def test_files_round_trip(client, conn):
    data = jsonl([completion_line("a", "Hi")])
    created = client.files.create(file=("mine.jsonl", data), purpose="batch")
    assert created.id.startswith("file-") and created.bytes == len(data)
    got = client.files.retrieve(created.id)
    assert (got.filename, got.purpose, got.status) == ("mine.jsonl", "batch", "processed")
    assert client.files.content(created.id).content == data
    assert client.files.delete(created.id).deleted is True
    with pytest.raises(openai.NotFoundError, match="No such File"):
        client.files.retrieve(created.id)


def test_files_list_pages_filters_and_keeps_tenants_apart(client, ports, conn):
    other, admin = api_client(ports[0], OTHER_KEY), api_client(ports[1], ADMIN_KEY)
    ids = [upload(client, [completion_line(f"r{i}", "Hi")]) for i in range(5)]
    theirs = upload(other, [completion_line("t", "Hi")])
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[::-1][:2] and page.has_more
    assert [f.id for f in client.files.list(limit=2)] == ids[::-1]  # auto-pagination
    raw = client.files.with_raw_response.list(limit=2, after=ids[3]).http_response.json()
    assert (raw["object"], [f["id"] for f in raw["data"]]) == ("list", [ids[2], ids[1]])
    assert (raw["first_id"], raw["last_id"], raw["has_more"]) == (ids[2], ids[1], True)
    oldest = client.files.list(order="asc", limit=3, after=ids[1])
    assert [f.id for f in oldest.data] == ids[2:] and oldest.has_more is False
    assert [f.id for f in client.files.list()] == ids[::-1]  # default limit: all of them
    assert [f.id for f in other.files.list()] == [theirs]
    assert {f.id for f in admin.files.list()} == {*ids, theirs}
    with pytest.raises(openai.BadRequestError, match="No such File"):
        other.files.list(after=ids[0])
    for bad in ({"limit": 0}, {"limit": 10_001}, {"order": "newest"}):
        with pytest.raises(openai.BadRequestError, match=next(iter(bad))):
            client.files.list(**bad)  # type: ignore[arg-type]
    client.files.delete(ids[4])
    assert [f.id for f in client.files.list(limit=1).data] == [ids[3]]


def test_files_list_by_purpose_skips_and_prunes_expired_files(client, conn):
    batch = create(client, upload(client, [completion_line("a", "Hi")]))
    client.batches.cancel(batch.id)
    error_file = wait_final(client, batch.id).error_file_id
    assert error_file is not None
    listed = client.files.list(purpose="batch_output")
    assert [(f.id, f.purpose) for f in listed] == [(error_file, "batch_output")]
    assert listed.data[0].expires_at is not None
    assert [f.id for f in client.files.list(purpose="batch")] == [batch.input_file_id]
    conn.pexpire(rk.file_record(error_file), 1)  # as it will, 30 days on
    conn.pexpire(rk.file_content(error_file), 1)
    while conn.exists(rk.file_record(error_file)):
        time.sleep(0.01)
    assert client.files.list(purpose="batch_output").data == []
    assert [f.id for f in client.files.list()] == [batch.input_file_id]
    assert conn.zscore(rk.files(), error_file) is None  # pruned


def test_api_keys_are_required(ports, conn):
    port = ports[0]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 401
    error = json.loads(e.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        api_client(port, "sk-wrong").models.list()
    assert api_client(port, OTHER_KEY).models.list().data == []


def test_upload_limits(client, ports, conn):
    with pytest.raises(openai.APIStatusError) as e:
        client.files.create(file=("big.jsonl", b"x" * (MAX_UPLOAD + 1)), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    lines = [completion_line(f"r{i}", "Hi") for i in range(MAX_LINES + 1)]
    with pytest.raises(openai.BadRequestError, match="at most 20"):
        upload(client, lines)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    assert _chunked_upload(ports[0], b"x" * (MAX_UPLOAD + 70_000)) == 413


def _chunked_upload(port: int, payload: bytes) -> int:
    """POST /v1/files without a Content-Length (chunked), as a streaming client would."""
    boundary = "mlxqtestboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    chunks = [head, *(payload[i : i + 8192] for i in range(0, len(payload), 8192)), tail]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {
        "Authorization": f"Bearer {KEY}",
        "Content-Type": f"multipart/form-data; boundary={boundary}",
    }
    try:
        conn.request("POST", "/v1/files", body=iter(chunks), headers=headers, encode_chunked=True)
        return conn.getresponse().status
    finally:
        conn.close()


# -- pieces -------------------------------------------------------------------------------


def test_command_refuses_to_serve_without_keys_or_open_without_auth(tmp_path):
    runner = CliRunner()
    no_keys = runner.invoke(api_command, [], env={"MLXQ_API_KEYS": ""})
    assert no_keys.exit_code == 2 and "no API keys" in no_keys.output
    open_ = runner.invoke(api_command, ["--no-auth", "--host", "0.0.0.0"])
    assert open_.exit_code == 2 and "loopback" in open_.output


def test_malformed_paths_and_bodies_are_4xx_not_500(client, ports, conn):
    file_id = upload(client, [completion_line("a", "Hi")])
    # OpenAI's own path shape with a colon: no object has that id, so a 404, not a 500.
    for path in (f"/v1/files/{file_id}:content", f"/v1/batches/{file_id}:cancel"):
        assert _raw(ports[0], "GET", path)[0] == 404
    # An unknown field is skipped, but skipping recurses: as deep as a hostile client likes.
    deep = b'{"extra": ' + b"[" * 200_000 + b"]" * 200_000 + b', "input_file_id": "x"}'
    status, body = _raw(ports[0], "POST", "/v1/batches", deep)
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    assert _raw(ports[0], "POST", "/v1/batches", b"{not json")[0] == 400
    too_big = b'{"input_file_id": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    assert _raw(ports[0], "POST", "/v1/batches", too_big)[0] == 413
    assert client.files.retrieve(file_id).id == file_id  # the server is still fine


def _raw(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    """(status, JSON body) of one raw HTTP request with the test key."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


# -- /v1/responses batches ------------------------------------------------------------------


def _responses_line(cid: str, **body: Any) -> dict:
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4, **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/responses", "body": body}


def test_a_responses_batch_runs_to_response_objects(client, conn, tiny_model):
    from openai.types.responses import Response

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    lines = [
        _responses_line("r1", instructions="Be brief", metadata={"run": "7"}),
        _responses_line("r2", input=parts),
        _responses_line(
            "r3",
            max_output_tokens=30,
            text={"format": {"type": "json_schema", "name": "v", "schema": schema, "strict": True}},
        ),
    ]
    batch = create(client, upload(client, lines), "/v1/responses")
    assert batch.status == "in_progress" and batch.endpoint == "/v1/responses"
    run_tiny_worker(tiny_model, conn)
    batch = wait_final(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    rows = read_jsonl(client, batch.output_file_id)
    bodies = {cid: Response.model_validate(row["response"]["body"]) for cid, row in rows.items()}
    first = bodies["r1"]
    assert first.id.startswith("resp_") and first.output[0].id.startswith("msg_")
    assert first.metadata == {"run": "7"} and first.model == tiny_model
    assert first.usage.output_tokens <= 4 and first.usage.total_tokens > first.usage.output_tokens
    for response in (bodies["r1"], bodies["r2"]):
        if response.status == "incomplete":  # the tiny model rarely stops within 4 tokens
            assert response.incomplete_details.reason == "max_output_tokens"
            assert response.output[0].status == "incomplete"
    assert json.loads(bodies["r3"].output_text)["ok"] in (True, False)
    assert bodies["r3"].status == "completed"


def test_a_responses_batch_refuses_what_mlxq_cannot_do_line_by_line(client, conn):
    lines = [
        _responses_line("ok"),
        _responses_line("tools", tools=[{"type": "function", "name": "f", "parameters": {}}]),
        _responses_line("prev", previous_response_id="resp_1"),
        _responses_line("img", input=[{"role": "user", "content": [{"type": "input_image"}]}]),
        _responses_line("reason", reasoning={"effort": "high"}),
        _responses_line("stream", stream=True),
        _responses_line("chat", messages=[{"role": "user", "content": "Hi"}]),
        chat_line("wrong", "Hi"),  # a good line, of another endpoint
    ]
    batch = wait_final(client, create(client, upload(client, lines), "/v1/responses").id)
    assert batch.status == "failed"
    errors = {e.line: (e.code, e.param) for e in batch.errors.data}
    assert errors == {
        2: ("invalid_request", "body.tools"),
        3: ("invalid_request", "body.previous_response_id"),
        4: ("invalid_request", "body.input[0].content[0]"),
        5: ("invalid_request", "body.reasoning"),
        6: ("invalid_request", "body.stream"),
        7: ("invalid_request", "body"),
        8: ("mismatched_endpoint", "url"),
    }
    assert "`messages` is `input` on /v1/responses" in batch.errors.data[5].message
    file_id = upload(client, [_responses_line("e")])
    with pytest.raises(openai.BadRequestError, match="embeddings are not supported yet"):
        create(client, file_id, "/v1/embeddings")
