"""``mlxq api`` under test: real uvicorn servers on the session's Valkey, clients of the
official ``openai`` package, batch-file lines, and a worker running the tiny model."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import uvicorn
from openai import OpenAI

from mlxq.api.app import ApiSettings, create_app
from mlxq.api.serving import ConnectionLimits, server_options
from mlxq.broker import keys
from mlxq.worker.launch import run_worker
from mlxq.worker.profile import WorkerProfile
from tests.helpers import TEST_PRESET, worker_record

KEY, OTHER_KEY, ADMIN_KEY = "sk-mlxq-test-1", "sk-mlxq-test-2", "sk-mlxq-admin"
MODEL = TEST_PRESET  # the queue is the model's last path component: its folder's name
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_UPLOAD = 16 * 1024
MAX_LINES = 20
FINAL = {"completed", "failed", "cancelled", "expired"}


# -- servers and clients ------------------------------------------------------------------


def serve(
    valkey_url: str,
    sweep_interval: float,
    allow_unserved_models: bool = True,
    expected_models: Sequence[str] = (),
) -> tuple[uvicorn.Server, threading.Thread, int]:
    """An API server on a free port, started on a thread: (server, thread, port).

    It queues batches for models no live worker serves unless told otherwise: most tests
    create their batches first and run the worker after (``test_api_models.py`` tests the
    default, which fails them).
    """
    settings = ApiSettings(
        allow_unserved_models=allow_unserved_models,
        expected_models=list(expected_models),
        redis_url=valkey_url,
        api_keys=[KEY, OTHER_KEY, ADMIN_KEY],
        admin_keys=[ADMIN_KEY],
        max_upload_bytes=MAX_UPLOAD,
        max_lines=MAX_LINES,
        sweep_interval=sweep_interval,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    options = server_options(ConnectionLimits())  # as `mlxq api` serves
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the API server did not start"
        time.sleep(0.02)
    return server, thread, sock.getsockname()[1]


def api_client(port: int, key: str = KEY) -> OpenAI:
    """The ``openai`` client of the server on ``port``, no retries."""
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


# -- helpers ------------------------------------------------------------------------------


def chat_line(cid: str, text: str, **body: Any) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        **body,
    }
    return {"custom_id": cid, "method": "POST", "url": CHAT, "body": body}


def completion_line(cid: str, prompt: Any, **body: Any) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **body}
    return {"custom_id": cid, "method": "POST", "url": COMPLETIONS, "body": body}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n" for ln in lines
    )


def upload(client: OpenAI, lines: list[Any]) -> str:
    return client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch").id


def create(client: OpenAI, file_id: str, endpoint: str = COMPLETIONS, **kw: Any):
    return client.batches.create(
        input_file_id=file_id, endpoint=endpoint, completion_window="24h", **kw
    )


def wait_final(client: OpenAI, batch_id: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)


def read_jsonl(client: OpenAI, file_id: str) -> dict[str, dict]:
    text = client.files.content(file_id).text
    return {row["custom_id"]: row for row in map(json.loads, text.splitlines())}


def run_tiny_worker(tiny_model: str, conn) -> None:
    run_worker(WorkerProfile(model=tiny_model, max_batch=4), conn, burst=True, queues=[MODEL])


def publish_worker(conn, name: str, model: str, queues: list[str]) -> None:
    """The record a live worker of ``model`` on ``queues`` publishes (no process behind it:
    it stays live until its key is deleted)."""
    now = time.time()
    info = worker_record(name=name, model=model, queues=queues, started_at=now, heartbeat_at=now)
    conn.set(keys.worker_info(name), msgspec.json.encode(info))
    conn.sadd(keys.workers(), name)
