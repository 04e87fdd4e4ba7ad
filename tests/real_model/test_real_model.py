"""The real-model tier: SmolLM2-135M-Instruct from its GGUF (tests/real_model.py), run
through mlxq as a user runs it. Real tokenizer (byte-level BPE, multi-byte characters split
across tokens), chat template, EOS at varied lengths, constraints over a 49k vocabulary."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import mlx.core as mx
import pytest
from engine_reference import reference
from engine_reference import run_all as run
from real_model import smollm, smollm_gguf  # noqa: F401 - fixtures
from test_constraints import PERSON, REGEX

from mlxq.broker import batches
from mlxq.broker.keys import queue_name_for_model
from mlxq.client import Client
from mlxq.engine.factory import make_engine
from mlxq.engine.sampling import Completion
from mlxq.wire import JsonSchemaFormat, JsonSchemaSpec, Message, RegexFormat, Request
from mlxq.worker.launch import run_worker
from mlxq.worker.profile import WorkerProfile

# Question, and a word any reader expects in the answer.
QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("How many days are in a week?", "7"),
    ("What is 2 + 2?", "4"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("Write one word: yes or no?", "Yes"),
]
# Answers (greedy) that end on EOS: Chinese, an emoji, French with accents and guillemets.
NON_ASCII = [
    "How do you write 'China' in Chinese characters?",
    "Which emoji means love?",
    "Repeat exactly: Ça va très bien, merci !",
]
# Cut by max_tokens inside an emoji's bytes: its chunks must hold the partial character back.
CUT_EMOJI = "Repeat this emoji: 🎉"


def chat(text: str, **options: Any) -> Request:
    return Request(messages=[Message("user", text)], **options)


@pytest.fixture(scope="module")
def engine(smollm: tuple[Any, Any]) -> Any:  # noqa: F811 - the fixture of that name
    made = make_engine(*smollm, "smollm", max_batch=8)
    made.warmup()
    return made


@pytest.fixture(scope="module")
def answers(engine: Any) -> tuple[dict[str, Request], dict[str, Completion]]:
    """The questions and a few plain completions, joining the batch two steps apart."""
    jobs = {f"q{i}": chat(text, max_tokens=48) for i, (text, _) in enumerate(QUESTIONS)}
    jobs["story"] = Request(prompt="Once upon a time, in a small village,", max_tokens=24)
    jobs["list"] = chat("List three fruits.", max_tokens=16)
    return jobs, run(engine, jobs, join_every=2)


def test_plain_questions_get_answers_a_reader_accepts_ending_on_eos(answers) -> None:
    lengths = set()
    for i, (text, word) in enumerate(QUESTIONS):
        c = answers[1][f"q{i}"]
        assert word.lower() in c.text.lower(), (text, c.text)
        assert c.finish_reason == "stop", (text, c.text)  # EOS (<|im_end|>), not max_tokens
        assert "<|im_end|>" not in c.text and c.text == c.text.strip()
        lengths.add(len(c.token_ids))
    assert len(lengths) >= 4, lengths  # EOS ends answers at varied lengths


def test_greedy_equals_mlx_lm_single_request_with_jobs_joining_mid_batch(
    smollm,  # noqa: F811
    engine,
    answers,
) -> None:
    model, tokenizer = smollm
    jobs, done = answers
    for key, request in jobs.items():
        ref = reference(model, tokenizer, engine.encode(request), request)
        c = done[key]
        assert c.token_ids == ref["tokens"], key
        assert c.text == ref["text"], key
        assert c.finish_reason == ("length" if len(ref["tokens"]) == request.max_tokens else "stop")


def test_logprobs_are_mlx_lm_s(smollm, engine) -> None:  # noqa: F811
    model, tokenizer = smollm
    request = chat("What is the capital of Japan?", max_tokens=10, logprobs=3)
    c = run(engine, {"lp": request})["lp"]
    ref = reference(model, tokenizer, engine.encode(request), request)
    assert [t.token_id for t in c.logprobs] == c.token_ids == ref["tokens"]
    for token_lp, ref_lp in zip(c.logprobs, ref["logprobs"], strict=True):
        # On the CPU they agree to 1e-4. On a GPU the batched forward and mlx-lm's single
        # request run other kernels (GEMM tilings by shape, the ragged attention), whose
        # float32 sums differ more: 1.2e-3 seen on the H200.
        tol = 1e-4 if mx.default_device() == mx.cpu else 1e-2
        assert token_lp.logprob == pytest.approx(ref_lp[token_lp.token_id].item(), abs=tol)
        assert [t.token_id for t in token_lp.top] == mx.argsort(-ref_lp)[:3].tolist()


def test_stop_strings_cut_the_text_with_the_real_tokenizer(engine) -> None:
    question = "What is the capital of France?"
    stops = {"word": ["Paris"], "space": [" of"], "inside": ["ital of Fr"], "two": ["zzz", "is"]}
    done = run(engine, {k: chat(question, max_tokens=20, stop=s) for k, s in stops.items()})
    full = "The capital of France is Paris."
    for key, stop in stops.items():
        cut = min(full.index(s) for s in stop if s in full)
        assert done[key].text == full[:cut], key
        assert done[key].finish_reason == "stop"


def test_structured_outputs_are_valid_on_the_49k_vocabulary(engine) -> None:
    city = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    fruits = {
        "type": "array",
        "items": {"enum": ["apple", "banana", "cherry", "mango"]},
        "minItems": 2,
        "maxItems": 3,
    }
    schemas = {"person": PERSON, "city": city, "fruits": fruits}
    jobs = {
        name: chat(
            f"Answer in JSON: {prompt}",
            max_tokens=120,
            response_format=JsonSchemaFormat(JsonSchemaSpec(schema=schemas[name], name=name)),
        )
        for name, prompt in (
            ("person", "describe a person."),
            ("city", "the capital of France."),
            ("fruits", "some fruits."),
        )
    }
    jobs["id"] = chat("Make up a product code.", max_tokens=20, response_format=RegexFormat(REGEX))
    done = run(engine, jobs, join_every=1)
    for name in schemas:
        assert done[name].finish_reason == "stop", done[name].text
        jsonschema.validate(json.loads(done[name].text), schemas[name])
    assert done["id"].finish_reason == "stop" and re.fullmatch(REGEX, done["id"].text)


def test_mlxq_worker_on_the_gguf_streams_clean_non_ascii_and_refuses_an_overlong_prompt(
    conn,
    valkey_url,
    smollm_gguf,  # noqa: F811
) -> None:
    requests = [chat(text, max_tokens=48, stream=True) for text in [*NON_ASCII, CUT_EMOJI]]
    requests.append(Request(prompt=[28] * 8185, max_tokens=16))  # 8,201 > 8,192 tokens
    queue = queue_name_for_model(smollm_gguf)
    assert queue == "SmolLM2-135M-Instruct.Q4_1"
    info = batches.submit(conn, requests, queue=queue)
    *streamed, cut, overlong = batches.batch_job_ids(conn, info.batch_id)
    # As `mlxq worker --model <gguf>` runs: its queues are the file's stem and default.
    worker = run_worker(WorkerProfile(model=smollm_gguf, max_batch=4), conn, burst=True)
    assert queue in worker.queue_names()
    client = Client(valkey_url)
    texts = []
    for job_id in streamed:
        result = client.result(job_id)
        chunks = [e.text for e in client.stream(job_id)]
        assert result.finish_reason == "stop" and result.error is None
        assert "\ufffd" not in result.text and all("\ufffd" not in t for t in chunks), chunks
        assert "".join(chunks) == result.text
        texts.append(result.text)
    assert "中国" in texts[0] and any(ord(ch) > 0x1F000 for ch in texts[1]), texts
    assert "Ça va très bien" in texts[2], texts[2]
    # Cut by max_tokens, maybe inside an emoji: the partial character is in neither the
    # chunks nor the result, and the two agree.
    cut_chunks = [e.text for e in client.stream(cut)]
    cut_result = client.result(cut)
    assert cut_result.finish_reason == "length" and "🎉" in "".join(cut_chunks)
    assert all("\ufffd" not in t for t in [*cut_chunks, cut_result.text]), cut_chunks
    assert "".join(cut_chunks) == cut_result.text
    refused = client.result(overlong)
    assert refused.error is not None and "\n" not in refused.error
    assert "context of" in refused.error and "8192 tokens" in refused.error


def test_rows_sorted_often_keep_mlx_lm_s_tokens(smollm, monkeypatch) -> None:  # noqa: F811
    """Issue 31: a sort moved live rows into the slots of rows that had just ended on EOS
    and fed them a one-step-old token ("can help help protect"). Small attention groups and
    a sort at every step make moves constant; every answer must stay mlx-lm's."""
    from mlxq.engine.slots import choices as slot_choices
    from mlxq.engine.slots import engine as slot_engine
    from mlxq.engine.slots import order as slot_order
    from mlxq.engine.slots import step as slot_step

    model, tokenizer = smollm
    monkeypatch.setattr(slot_step, "GROUP_ROWS", 2)
    monkeypatch.setattr(slot_engine, "SORT_EVERY", 1)
    monkeypatch.setattr(slot_order, "SORT_GAIN", 0.999)
    monkeypatch.setenv(slot_choices.SORT_ENV, "1")
    monkeypatch.setenv(slot_choices.COMPILE_ENV, "0")  # (the compiled forward never sorts)
    asks = ["Name a fruit.", "What color is the sky?", "Say hello.", "Count to five."]
    asks += [text for text, _ in QUESTIONS] + ["Write two sentences about the sea."]
    jobs = {f"s{i}": chat(text, max_tokens=12 + 4 * (i % 4)) for i, text in enumerate(asks)}
    sorted_engine = make_engine(model, tokenizer, "smollm", max_batch=16)
    done = run(sorted_engine, jobs, join_every=1)
    assert sorted_engine.stats().sorts >= 3
    assert sum(c.finish_reason == "stop" for c in done.values()) >= 4  # rows end on EOS
    for key, request in jobs.items():
        ref = reference(model, tokenizer, sorted_engine.encode(request), request)
        assert done[key].token_ids == ref["tokens"], key


def test_chat_questions_reuse_the_template_s_system_prompt(smollm) -> None:  # noqa: F811
    """A burst of chat questions, the prefix cache on as a worker has it: SmolLM2's template
    starts each with the same default system prompt, which one job stores and the others
    reuse (a block of it), prefilled in groups with questions that begin alike. Every
    answer is mlx-lm's, and the readers' words are there."""
    model, tokenizer = smollm
    asks = [text for text, _ in QUESTIONS] + ["What is the capital of Italy?", "Say hello."]
    jobs = {f"c{i}": chat(text, max_tokens=32) for i, text in enumerate(asks)}
    cached = make_engine(model, tokenizer, "smollm", max_batch=8, prefix_cache_bytes=64 << 20)
    done = run(cached, jobs)
    stats = cached.stats()
    assert stats.prefix_hits == len(jobs) - 1 and stats.reused_tokens >= 16 * (len(jobs) - 1)
    for i, (text, word) in enumerate(QUESTIONS):
        assert word.lower() in done[f"c{i}"].text.lower(), (text, done[f"c{i}"].text)
    for key, request in jobs.items():
        ref = reference(model, tokenizer, cached.encode(request), request)
        assert done[key].token_ids == ref["tokens"], key
        assert done[key].text == ref["text"], key
