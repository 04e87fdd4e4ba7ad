"""Logprobs in OpenAI's schema on the real model (SmolLM2-135M-Instruct's GGUF, byte-level
BPE with characters split across tokens): each token's ``bytes`` joined are the answer's
UTF-8 bytes, out of ``mlxq results --format openai`` and ``mlxq api``'s output files, as
the openai SDK reads them."""

from __future__ import annotations

import json
from typing import Any

from api_servers import CHAT, chat_line, create, read_jsonl, upload, wait_final
from helpers import run_mlxq
from openai.types.chat import ChatCompletion
from real_model import smollm_gguf  # noqa: F401 - fixture
from test_real_model import CUT_EMOJI, NON_ASCII

from mlxq.broker.keys import queue_name_for_model
from mlxq.worker.launch import run_worker
from mlxq.worker.profile import WorkerProfile


def lines(model: str) -> list[dict[str, Any]]:
    """The non-ASCII questions (Chinese, an emoji, French), greedy, with 3 alternatives."""
    asks = [chat_line(f"q{i}", text, max_tokens=48) for i, text in enumerate(NON_ASCII)]
    asks.append(chat_line("cut", CUT_EMOJI, max_tokens=12))
    for line in asks:
        line["body"].update(model=model, logprobs=True, top_logprobs=3, temperature=0)
    return asks


def check(rows: dict[str, dict]) -> dict[str, ChatCompletion]:
    """Every answer's tokens, as the openai SDK parses them, spell it byte for byte."""
    parsed = {cid: ChatCompletion.model_validate(r["response"]["body"]) for cid, r in rows.items()}
    for cid, body in parsed.items():
        choice = body.choices[0]
        content = choice.logprobs.content
        assert all(len(e.top_logprobs) == 3 for e in content), cid
        data = b"".join(bytes(e.bytes) for e in content)
        if choice.finish_reason == "stop":
            assert data == choice.message.content.encode(), cid
        else:  # cut by max_tokens: a partial character is held out of the text
            assert data.decode("utf-8", "replace").rstrip("\ufffd") == choice.message.content
        for e in content:
            whole = e.token == bytes(e.bytes).decode("utf-8", "replace")
            assert whole or e.token.startswith("bytes:"), e
    answers = [parsed[f"q{i}"].choices[0].message.content for i in range(len(NON_ASCII))]
    assert "中国" in answers[0] and "Ça va très bien" in answers[2], answers
    # Characters split across tokens: some tokens hold part of one, named by escapes.
    tokens = [e.token for body in parsed.values() for e in body.choices[0].logprobs.content]
    assert any(t.startswith("bytes:") for t in tokens), tokens
    return parsed


def test_results_format_openai_spells_non_ascii_answers(
    valkey_url,
    conn,
    tmp_path,
    smollm_gguf,  # noqa: F811
) -> None:
    queue = queue_name_for_model(smollm_gguf)
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines(queue)))
    submitted = run_mlxq("submit", str(src), "--queue", queue, "--json", url=valkey_url)
    batch = json.loads(submitted.stdout)["batch_id"]
    run_worker(WorkerProfile(model=smollm_gguf, max_batch=4), conn, burst=True, queues=[queue])
    out = tmp_path / "out.jsonl"
    res = run_mlxq("results", batch, "--format", "openai", "-o", str(out), url=valkey_url)
    assert res.returncode == 0, res.stderr
    check({r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())})


def test_api_output_file_spells_non_ascii_answers(client, conn, smollm_gguf) -> None:  # noqa: F811
    queue = queue_name_for_model(smollm_gguf)
    batch = create(client, upload(client, lines(queue)), CHAT)
    run_worker(WorkerProfile(model=smollm_gguf, max_batch=4), conn, burst=True, queues=[queue])
    batch = wait_final(client, batch.id, timeout=60)
    assert batch.status == "completed", batch
    check(read_jsonl(client, batch.output_file_id))
