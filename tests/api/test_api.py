"""``mlxq api`` end to end: the official ``openai`` client against real uvicorn servers, a
real Valkey and a real worker running the tiny model (the servers: ``api_servers.py``;
files, keys and upload limits: ``test_api_files.py``)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from api_servers import (
    CHAT,
    COMPLETIONS,
    MODEL,
    chat_line,
    completion_line,
    create,
    publish_worker,
    read_jsonl,
    run_tiny_worker,
    upload,
    wait_final,
)

from mlxq.api import redis_keys as rk
from mlxq.broker import batches, keys
from tests.helpers import waiting

# -- the whole flow -----------------------------------------------------------------------


def test_batches_run_to_completed_with_output_and_error_files(client, client_b, conn, tiny_model):
    chat_file = upload(client, [chat_line("c1", "Hello"), chat_line("c2", "Bye", seed=3)])
    comp_file = upload(
        client, [completion_line("t1", "Once upon"), completion_line("bad", [99999999])]
    )
    chat = create(client, chat_file, CHAT, metadata={"job": "e2e"})
    comp = create(client_b, comp_file)
    assert chat.status == "in_progress" and chat.in_progress_at is not None
    assert chat.request_counts.total == 2 and chat.metadata == {"job": "e2e"}
    assert chat.expires_at == chat.created_at + 24 * 3600 and chat.completion_window == "24h"
    assert chat.model == MODEL and chat.endpoint == CHAT

    run_tiny_worker(tiny_model, conn)

    # Several readers on two servers see the batch done at once: one finalizes.
    clients = [client, client_b] * 4
    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(lambda c: c.batches.retrieve(comp.id), clients))
    comp = wait_final(client, comp.id)
    assert comp.status == "completed" and comp.completed_at and comp.finalizing_at
    assert {b.output_file_id for b in seen if b.status == "completed"} <= {comp.output_file_id}
    assert (comp.request_counts.total, comp.request_counts.completed) == (2, 1)
    assert comp.request_counts.failed == 1 and comp.usage.output_tokens > 0

    out = read_jsonl(client, comp.output_file_id)
    assert set(out) == {"t1"}
    row = out["t1"]
    assert row["id"].startswith("batch_req_") and row["error"] is None
    assert row["response"]["status_code"] == 200 and row["response"]["request_id"]
    body = row["response"]["body"]
    assert body["object"] == "text_completion" and body["model"] == tiny_model
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert isinstance(body["choices"][0]["text"], str)
    assert 0 < body["usage"]["completion_tokens"] <= 4
    errors = read_jsonl(client, comp.error_file_id)
    assert set(errors) == {"bad"} and errors["bad"]["response"] is None
    assert errors["bad"]["error"]["code"] == "request_failed"
    assert "vocab" in errors["bad"]["error"]["message"].lower()

    # Nobody has read the chat batch since: server B's background sweep finalizes it.
    deadline = time.monotonic() + 10
    while json.loads(conn.get(rk.batch_record(chat.id)))["batch"]["status"] != "completed":
        assert time.monotonic() < deadline, "the sweep did not finalize the batch"
        time.sleep(0.05)
    chat = client.batches.retrieve(chat.id)
    assert chat.status == "completed" and chat.error_file_id is None
    assert chat.request_counts.completed == 2
    rows = read_jsonl(client, chat.output_file_id)
    message_body = rows["c2"]["response"]["body"]
    assert message_body["object"] == "chat.completion"
    assert message_body["choices"][0]["message"]["role"] == "assistant"
    assert message_body["usage"]["total_tokens"] > message_body["usage"]["completion_tokens"]


def test_response_format_through_the_openai_client(client, conn, tiny_model):
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    }
    as_schema = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    lines = [
        chat_line("s1", "Is it?", max_tokens=60, response_format=as_schema),
        chat_line("s2", "Really?", max_tokens=60, response_format=as_schema, temperature=1),
        chat_line("free", "Hi", response_format={"type": "text"}),
    ]
    batch = create(client, upload(client, lines), CHAT)
    bad = [chat_line("b", "x", response_format={"type": "regex", "pattern": "(x"})]
    refused = wait_final(client, create(client, upload(client, bad), CHAT).id)
    assert refused.status == "failed" and refused.errors.data[0].line == 1
    assert "response_format.pattern" in refused.errors.data[0].message

    run_tiny_worker(tiny_model, conn)

    batch = wait_final(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    rows = read_jsonl(client, batch.output_file_id)
    for cid in ("s1", "s2"):
        choice = rows[cid]["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        answer = json.loads(choice["message"]["content"])
        assert answer["answer"] in ("yes", "no") and 0 <= answer["confidence"] <= 100
        assert set(answer) == {"answer", "confidence"}


def test_bad_input_file_fails_validation_with_line_errors(client, conn):
    lines = [
        completion_line("ok", "Hi"),
        b'{"custom_id": "broken", ',
        chat_line("wrong-endpoint", "Hi"),
        completion_line("n0", "Hi", n=0),
        completion_line("other-model", "Hi", model="another"),
    ]
    batch = create(client, upload(client, lines))
    assert batch.status == "failed" and batch.failed_at is not None
    assert [e.line for e in batch.errors.data] == [2, 3, 4]  # (a line may name its model)
    codes = {e.line: e.code for e in batch.errors.data}
    assert codes[3] == "mismatched_endpoint"
    assert "body.n" in batch.errors.data[2].message
    assert client.batches.retrieve(batch.id).status == "failed"
    assert waiting(conn, MODEL) == 0


def test_create_refuses_bad_parameters(client, conn):
    file_id = upload(client, [completion_line("a", "Hi")])
    with pytest.raises(openai.NotFoundError):
        create(client, "file-nope")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        create(client, file_id, "/v1/embeddings")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file_id, endpoint=COMPLETIONS, completion_window="1h")


def test_cancel_before_any_worker_runs(client, client_b, conn):
    batch = create(client, upload(client, [completion_line(f"r{i}", "Hi") for i in range(3)]))
    assert waiting(conn, MODEL) == 3
    cancelled = client_b.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    batch = wait_final(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.cancelling_at
    assert waiting(conn, MODEL) == 0
    assert batch.output_file_id is None
    assert batch.request_counts.total == 3 and batch.request_counts.failed == 3
    errors = read_jsonl(client, batch.error_file_id)
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # idempotent


def test_a_cancel_runs_once_on_its_own_thread_and_reads_never_wait_on_it(
    client, client_b, conn, monkeypatch
):
    """However many cancels and reads come meanwhile (two servers, one sweeping), the jobs
    are cancelled once, on a thread; the cancel has already flagged the batch when it
    answers (no worker starts one of its jobs), and no read waits for the slow part."""
    from mlxq.api import batches as api_batches

    cancel_batch, ended = api_batches.batches.cancel_batch, []

    def slow_cancel(conn_, mlxq_id, stop_running=True):
        if stop_running:  # (the end's; finalization's own look passes False)
            ended.append(mlxq_id)
            time.sleep(3)
        return cancel_batch(conn_, mlxq_id, stop_running)

    monkeypatch.setattr(api_batches.batches, "cancel_batch", slow_cancel)
    batch = create(client, upload(client, [completion_line(f"r{i}", "Hi") for i in range(3)]))
    mlxq_id = json.loads(conn.get(rk.batch_record(batch.id)))["mlxq_batch_id"]

    def timed(call):
        t = time.monotonic()
        return call(), time.monotonic() - t

    with ThreadPoolExecutor(6) as pool:
        calls = [
            pool.submit(timed, lambda c=c: c.batches.cancel(batch.id)) for c in (client, client_b)
        ] + [
            pool.submit(timed, lambda c=c: c.batches.retrieve(batch.id))
            for c in (client, client_b) * 2
        ]
        answers = [c.result() for c in calls]
    assert all(took < 1.0 for _, took in answers), [took for _, took in answers]
    assert conn.get(keys.batch_cancelled(mlxq_id)) == b"stop"
    assert batches.get_batch(conn, mlxq_id).state == "cancelled"
    for _ in range(5):
        read, took = timed(lambda: client.batches.retrieve(batch.id))
        assert read.status == "cancelling" and took < 1.0
    batch = wait_final(client, batch.id)
    assert batch.status == "cancelled" and batch.request_counts.failed == 3
    assert ended == [mlxq_id]


def test_cancel_refuses_finished_batches(client, conn):
    batch = create(client, upload(client, [b"not json"]))
    assert batch.status == "failed"
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.batches.cancel(batch.id)


def test_past_its_window_a_batch_expires(client, conn):
    batch = create(client, upload(client, [completion_line(f"r{i}", "Hi") for i in range(2)]))
    key = rk.batch_record(batch.id)
    state = json.loads(conn.get(key))
    state["batch"]["expires_at"] = int(time.time()) - 1
    conn.set(key, json.dumps(state), keepttl=True)
    batch = wait_final(client, batch.id)
    assert batch.status == "expired" and batch.expired_at is not None
    assert waiting(conn, MODEL) == 0
    errors = read_jsonl(client, batch.error_file_id)
    assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}


def _edit_record(conn, batch_id: str, **changes: Any) -> None:
    key = rk.batch_record(batch_id)
    state = json.loads(conn.get(key))
    for name, value in changes.items():
        if name in state:
            state[name] = value
        else:
            state["batch"][name] = value
    conn.set(key, json.dumps(state), keepttl=True)


def test_work_left_by_a_dead_process_is_taken_over(client, conn):
    # Validation cut short (its lock is gone): the batch fails and its jobs are cancelled.
    stuck = create(client, upload(client, [completion_line("v", "Hi")]))
    # The other server's sweeper may hold the lock at that moment: wait, do not read once.
    _edit_record(conn, stuck.id, status="validating", submitted=False)
    stuck = wait_final(client, stuck.id)
    assert stuck.status == "failed" and stuck.errors.data[0].code == "validation_interrupted"
    assert waiting(conn, MODEL) == 0
    # Finalization cut short: the next reader finishes it (here with jobs never run).
    left = create(
        client, upload(client, [completion_line("f1", "Hi"), completion_line("f2", "Ho")])
    )
    _edit_record(conn, left.id, status="finalizing")
    left = wait_final(client, left.id)
    assert left.status == "completed" and left.request_counts.failed == 2
    errors = read_jsonl(client, left.error_file_id)
    assert set(errors) == {"f1", "f2"}
    assert {e["error"]["code"] for e in errors.values()} == {"request_incomplete"}


# -- listing, models, files, auth, limits -------------------------------------------------


def test_list_batches_paginates_newest_first(client, conn):
    file_id = upload(client, [completion_line("a", "Hi")])
    ids = [create(client, file_id).id for _ in range(5)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    raw = client.batches.with_raw_response.list(limit=2, after=ids[3]).http_response.json()
    assert [b["id"] for b in raw["data"]] == [ids[2], ids[1]]
    assert raw["first_id"] == ids[2] and raw["last_id"] == ids[1] and raw["has_more"] is True
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # auto-pagination
    last = client.batches.list(limit=2, after=ids[1])
    assert [b.id for b in last.data] == [ids[0]] and last.has_more is False


def test_models_lists_what_live_workers_serve(client, conn):
    publish_worker(conn, "w1", "mlx-community/Foo-4bit", [MODEL])
    publish_worker(conn, "w2", "mlx-community/Foo-4bit", [MODEL])
    publish_worker(conn, "w3", "tiny", [MODEL])
    conn.sadd(keys.workers(), "gone")  # "gone": its info expired
    models = client.models.list()
    assert [m.id for m in models] == ["Foo-4bit", "tiny"]
    assert all(m.owned_by == "mlxq" for m in models)
