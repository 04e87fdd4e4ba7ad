"""Eval frameworks and SDKs as clients of ``mlxq api``, each as its users run it: a real
``mlxq api`` process and a real long-lived ``mlxq worker`` on the real SmolLM2-135M-Instruct
GGUF (``real_model.py``), reached only through the clients' own code.

* inspect-ai's batch mode with its default settings (``inspect eval --batch``: the
  Responses API for a model name it does not know, 15-second send delay and polling);
* the official ``openai`` SDK's batch path with ``/v1/responses`` lines, and with
  ``/v1/chat/completions`` lines: each output body parses as the SDK's own type.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from api_servers import KEY, api_client, create, jsonl, read_jsonl, upload, wait_final
from helpers import ROOT, Worker, free_port, wait_for_port
from real_model import smollm_gguf  # noqa: F401 - the fixture

from mlxq.broker.keys import queue_name_for_model

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is 2 + 2?", "4"),
]
FINAL = {"completed", "failed", "cancelled", "expired"}
INSPECT = Path(sys.executable).with_name("inspect")

TASK = """
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import includes
from inspect_ai.solver import generate

QUESTIONS = {questions!r}


@task
def questions():
    return Task(
        dataset=[Sample(input=q, target=a) for q, a in QUESTIONS],
        solver=generate(),
        scorer=includes(),
        config=GenerateConfig(max_tokens=32),
    )
"""


class Served:
    """The API's port and the short name that routes a line to the worker's model."""

    def __init__(self, port: int, model: str) -> None:
        self.port = port
        self.model = model

    def client(self) -> openai.OpenAI:
        return api_client(self.port)


@pytest.fixture(scope="module")
def served(
    valkey_url: str,
    smollm_gguf: str,  # noqa: F811 - the fixture of that name
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    """A long-lived worker of the GGUF and an ``mlxq api`` process, on one Redis."""
    logs = tmp_path_factory.mktemp("clients")
    conn = redis.Redis.from_url(valkey_url)
    conn.flushall()  # once: the worker's record must outlive every test of the module
    worker = Worker(valkey_url, smollm_gguf, log=logs / "worker.log")
    port = free_port()
    env = {**os.environ, "MLXQ_REDIS_URL": valkey_url, "MLXQ_API_KEYS": KEY}
    cmd = [sys.executable, "-m", "mlxq", "api", "--port", str(port)]
    with (logs / "api.log").open("w") as api_log:
        api = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=api_log, stderr=subprocess.STDOUT)
    try:
        worker.wait_listening(conn, timeout=300)
        wait_for_port(port, api, timeout=60)
        yield Served(port, queue_name_for_model(smollm_gguf))
    finally:
        api.terminate()
        api.wait(30)
        worker.stop()
        conn.close()


def _has_words(text: str) -> bool:
    """Whether a person could read ``text``: letters, not only symbols or token debris."""
    return sum(c.isalpha() for c in text) >= 2


def _run_batch(served: Served, lines: list[dict[str, Any]], endpoint: str) -> dict[str, dict]:
    """Upload, create, poll and download through the SDK: the output lines by custom_id."""
    client = served.client()
    batch = create(client, upload(client, lines), endpoint)
    assert batch.status == "in_progress", batch.errors
    batch = wait_final(client, batch.id, timeout=180)
    assert batch.status == "completed" and batch.error_file_id is None, batch
    assert batch.request_counts.completed == len(lines)
    return read_jsonl(client, batch.output_file_id)


def test_models_lists_the_worker_s_model_by_the_name_lines_use(served, smollm_gguf):  # noqa: F811
    client = served.client()
    [model] = [m for m in client.models.list() if m.id == served.model]
    extra = model.model_extra or {}
    assert (extra["source"], extra["status"]) == (smollm_gguf, "live")
    assert client.models.retrieve(served.model).id == served.model


def test_inspect_ai_batch_mode_with_default_settings(served, tmp_path: Path):
    """``inspect eval --model openai/<short name> --batch``: inspect probes POST
    /v1/responses (a 404 it takes as "no reasoning summaries"), sends a batch of
    /v1/responses lines, polls it and parses the output as the SDK's Response objects."""
    if not INSPECT.is_file():
        pytest.skip("inspect-ai is not installed (the test extra has it)")
    (tmp_path / "task.py").write_text(TASK.format(questions=QUESTIONS))
    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"http://127.0.0.1:{served.port}/v1",
        "OPENAI_API_KEY": KEY,
        "INSPECT_LOG_DIR": str(tmp_path / "logs"),
        "INSPECT_DISPLAY": "plain",
        "NO_COLOR": "1",
    }
    cmd = [str(INSPECT), "eval", "task.py", "--model", f"openai/{served.model}", "--batch"]
    cmd += ["--log-format", "json"]
    start = time.monotonic()
    done = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output
    [log_file] = (tmp_path / "logs").glob("*.json")
    log = json.loads(log_file.read_text())
    assert log["status"] == "success", output
    samples = log["samples"]
    assert len(samples) == 3 and all(s.get("error") is None for s in samples)
    for sample in samples:
        text = sample["output"]["choices"][0]["message"]["content"]
        text = text if isinstance(text, str) else " ".join(c.get("text", "") for c in text)
        assert _has_words(text), sample["output"]
        assert "includes" in sample["scores"]
    assert log["results"]["completed_samples"] == 3
    assert time.monotonic() - start < 240
    endpoints = {b.endpoint for b in served.client().batches.list()}
    assert "/v1/responses" in endpoints, endpoints  # its default for an unknown model name


def test_openai_sdk_batch_of_responses_lines(served):
    from openai.types.responses import Response

    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": served.model,
                "instructions": "Answer in one short sentence.",
                "input": question if i else [{"role": "user", "content": question}],
                "max_output_tokens": 24,
            },
        }
        for i, (question, _) in enumerate(QUESTIONS)
    ]
    lines.append(
        {
            "custom_id": "json",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": served.model,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "A city?"}]}],
                "max_output_tokens": 40,
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "city",
                        "strict": True,
                        "schema": {
                            "type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"],
                            "additionalProperties": False,
                        },
                    }
                },
            },
        }
    )
    rows = _run_batch(served, lines, "/v1/responses")
    assert set(rows) == {"r0", "r1", "r2", "json"}
    for cid, row in rows.items():
        response = Response.model_validate(row["response"]["body"])
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.status in ("completed", "incomplete")
        assert response.usage and 0 < response.usage.output_tokens <= 40
        assert _has_words(response.output_text), (cid, response.output_text)
    city = Response.model_validate(rows["json"]["response"]["body"])
    assert city.status == "completed" and isinstance(json.loads(city.output_text)["city"], str)


def test_openai_sdk_batch_of_chat_completions_lines(served):
    from openai.types.chat import ChatCompletion

    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": served.model,
                "messages": [{"role": "user", "content": question}],
                "max_completion_tokens": 24,
            },
        }
        for i, (question, _) in enumerate(QUESTIONS)
    ]
    rows = _run_batch(served, lines, "/v1/chat/completions")
    assert set(rows) == {"c0", "c1", "c2"}
    for cid, row in rows.items():
        completion = ChatCompletion.model_validate(row["response"]["body"])
        text = completion.choices[0].message.content or ""
        assert _has_words(text), (cid, text)
        assert completion.choices[0].finish_reason in ("stop", "length")


def test_unsupported_lines_fail_validation_naming_the_field(served):
    client = served.client()
    base = {"custom_id": "t", "method": "POST", "url": "/v1/responses"}
    body = {"model": served.model, "input": "Hi", "tools": [{"type": "web_search"}]}
    batch = create(client, upload(client, [{**base, "body": body}]), "/v1/responses")
    [error] = client.batches.retrieve(batch.id).errors.data
    assert (error.code, error.line, error.param) == ("invalid_request", 1, "body.tools")
    with pytest.raises(openai.BadRequestError, match="embeddings are not supported yet"):
        file_id = client.files.create(file=("e.jsonl", jsonl([base])), purpose="batch").id
        create(client, file_id, "/v1/embeddings")
    with pytest.raises(openai.NotFoundError, match="in batches only"):
        client.responses.create(model=served.model, input="Hi")
