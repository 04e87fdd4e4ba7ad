"""Tests of mlxq.formats.inputs: reading `mlxq submit` JSONL files (mlxq and OpenAI batch lines)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import msgspec
import pytest

from mlxq.formats.inputs import (
    InputFileError,
    InvalidLine,
    LineError,
    ParsedInput,
    parse_line,
    parse_lines,
    read_requests,
    request_from_openai,
)
from mlxq.wire import Message, Request, json_encoder

DATA = Path(__file__).resolve().parents[1] / "data" / "inputs"
BAD = DATA / "bad"
BAD_CASES = sorted(p.stem for p in BAD.glob("*.jsonl"))


def read_expect(name: str) -> dict[int, str]:
    """A bad case's sidecar: ``LINE: substring`` lines; ``#`` starts a comment."""
    expect = {}
    for row in (BAD / f"{name}.expect").read_text().splitlines():
        if row.strip() and not row.startswith("#"):
            line, _, substring = row.partition(": ")
            expect[int(line)] = substring
    return expect


def chat(**body) -> dict:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion(**body) -> dict:
    body.setdefault("prompt", "hi")
    return {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body}


# --------------------------------------------------------------------------------------
# Good input


def test_a_file_mixing_models_names_each_lines_model():
    lines = [
        {"prompt": "a", "model": "org/A"},
        {"prompt": "b"},
        {"custom_id": "oa", "method": "POST", "url": "/v1/completions",
         "body": {"model": "B.gguf", "prompt": "x"}},
        {"messages": [{"role": "user", "content": "hi"}], "model": "org/A"},
    ]  # fmt: skip
    parsed = parse_lines(json.dumps(x) for x in lines)
    assert parsed.errors == []
    assert [r.model for r in parsed.requests] == ["org/A", None, "B.gguf", "org/A"]
    assert parsed.requests[2].metadata == {"model": "B.gguf"}  # (still copied, as before)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "a", "model": 3}, "model: Expected `str | null`, got `int`"),
        ({"prompt": "a", "model": ""}, "model: Expected `str` of length >= 1"),
        ({"custom_id": "c", "method": "POST", "url": "/v1/completions",
          "body": {"prompt": "x", "model": ["A"]}}, "body.model: expected a string"),
    ],
)  # fmt: skip
def test_a_bad_model_is_refused_naming_its_line_and_field(line, message):
    parsed = parse_lines(["{}", json.dumps(line)])
    assert [e.line for e in parsed.errors] == [1, 2]
    assert parsed.errors[1].message.startswith(message), parsed.errors[1].message


def test_good_mixed_file():
    parsed = read_requests(DATA / "good_mixed.jsonl")
    assert parsed.errors == []
    assert parsed.lines == [1, 2, 3, 5, 6, 7, 8, 9, 11]
    by_id = dict(zip([r.custom_id for r in parsed.requests], parsed.requests, strict=True))
    assert list(by_id) == [
        "text-greedy",
        "tokens",
        "chat-sampled",
        "oa-chat",
        "oa-completion",
        "line-7",
        "oa-completion-tokens",
        "all-fields",
        "oa-chat-greedy",
    ]
    assert by_id["text-greedy"] == Request(
        prompt="The capital of France is", max_tokens=16, custom_id="text-greedy"
    )
    assert by_id["tokens"].prompt == [1, 450, 7483, 310, 3444, 338]
    sampled = by_id["chat-sampled"]
    assert sampled.messages == [
        Message("system", "You are terse."),
        Message("user", "Name a prime."),
    ]
    assert (sampled.temperature, sampled.top_p, sampled.seed, sampled.stop) == (
        0.7,
        0.9,
        42,
        ["\n\n"],
    )
    assert by_id["oa-chat"] == Request(
        messages=[Message("user", "Describe the sea\nin one line.")],
        max_tokens=32,
        temperature=0.5,
        logprobs=2,
        custom_id="oa-chat",
        metadata={"model": "gpt-4o-mini"},
        model="gpt-4o-mini",
    )
    assert by_id["oa-completion"] == Request(
        prompt="Once upon a time",
        max_tokens=20,
        stop=["\n"],
        logprobs=1,
        custom_id="oa-completion",
        metadata={"model": "davinci-002"},
        model="davinci-002",
    )
    assert by_id["line-7"] == Request(prompt="no custom_id here", max_tokens=4, custom_id="line-7")
    assert by_id["oa-completion-tokens"] == Request(
        prompt=[9906, 1917],
        temperature=1.0,
        seed=7,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        custom_id="oa-completion-tokens",
    )
    assert by_id["all-fields"].metadata == {"source": "test", "tags": ["a"]}
    assert by_id["all-fields"].logprobs == 0
    greedy = by_id["oa-chat-greedy"]
    assert greedy == Request(
        messages=[Message("user", "Hi")],
        max_tokens=8,
        custom_id="oa-chat-greedy",
        metadata={"model": "m"},
        model="m",
    )
    # Everything read survives the trip to Redis.
    for r in parsed.requests:
        assert msgspec.json.decode(json_encoder.encode(r), type=Request) == r


def test_bom_at_file_start_and_crlf(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n{"prompt": "b"}\r\n')
    parsed = read_requests(p)
    assert [r.prompt for r in parsed.requests] == ["a", "b"]
    assert parsed.lines == [1, 3]


def test_openai_defaults_and_nulls():
    r = request_from_openai(chat(), 3)
    assert r == Request(messages=[Message("user", "hi")], custom_id="c")
    assert r.max_tokens == Request(prompt="x").max_tokens
    r = request_from_openai(
        chat(max_tokens=None, temperature=None, logprobs=None, n=None, stream=None), 3
    )
    assert r == Request(messages=[Message("user", "hi")], custom_id="c")
    assert request_from_openai(chat(logprobs=True), 1).logprobs == 0
    assert request_from_openai(chat(logprobs=False), 1).logprobs is None
    assert request_from_openai(chat(max_tokens=7, max_completion_tokens=7), 1).max_tokens == 7
    assert request_from_openai(completion(prompt=["only one"]), 1).prompt == "only one"
    assert request_from_openai(completion(prompt=[5, 6]), 1).prompt == [5, 6]
    assert request_from_openai(completion(logprobs=0), 1).logprobs == 0
    assert request_from_openai(completion(stop=["a", "b"]), 1).stop == ["a", "b"]
    r = request_from_openai(completion(model="m", metadata={"k": "v"}, user="u"), 1)
    assert r.metadata == {"k": "v", "model": "m"}
    obj = completion()
    obj["url"] = "/v1/completions/"
    obj["method"] = "post"
    assert request_from_openai(obj, 1).prompt == "hi"


def test_openai_n_asks_for_samples():
    assert request_from_openai(chat(n=4, seed=9, temperature=1), 1).n == 4
    assert request_from_openai(completion(n=1), 1).n == 1
    assert parse_line(b'{"prompt": "x", "n": 3}', 1).n == 3
    for bad, says in ((0, ">= 1"), (129, "<= 128"), (True, "got `bool`")):
        with pytest.raises(InvalidLine, match=f"body.n: .*{says}"):
            request_from_openai(chat(n=bad), 1)


def test_parse_line_accepts_str_and_assigns_custom_id():
    assert parse_line('{"prompt": "x"}', 12).custom_id == "line-12"
    assert parse_line(b'{"prompt": "x", "custom_id": "mine"}\n', 12).custom_id == "mine"


# --------------------------------------------------------------------------------------
# Bad input corpus: every case names the right line and field.


@pytest.mark.parametrize("name", BAD_CASES)
def test_bad_corpus(name):
    expect = read_expect(name)
    assert expect, f"{name}.expect lists no lines"
    with pytest.raises(InputFileError) as info:
        read_requests(BAD / f"{name}.jsonl")
    got = {e.line: e.message for e in info.value.errors}
    assert sorted(got) == sorted(expect), got
    for line, substring in expect.items():
        assert substring in got[line], f"line {line}: {got[line]!r}"
        # One line per error, so the report stays one line per bad input line.
        assert "\n" not in got[line]
    assert info.value.path == str(BAD / f"{name}.jsonl")


def test_every_bad_case_has_an_expect_file():
    assert len(BAD_CASES) >= 12
    for name in BAD_CASES:
        assert (BAD / f"{name}.expect").is_file(), name


@pytest.mark.parametrize("name", BAD_CASES)
def test_bad_corpus_skip_invalid(name):
    expect = read_expect(name)
    try:
        parsed = read_requests(BAD / f"{name}.jsonl", skip_invalid=True)
    except InputFileError as e:  # nothing valid in the file
        assert e.summary and e.summary.startswith("no valid requests in ")
        assert [x.line for x in e.errors] == sorted(expect)
        return
    assert [e.line for e in parsed.errors] == sorted(expect)
    assert not set(parsed.lines) & set(expect)
    assert len(parsed.lines) == len(parsed.requests)


def test_parse_line_chains_msgspec_cause():
    with pytest.raises(InvalidLine) as info:
        parse_line(b'{"prompt": "a", "max_tokens": 0}', 4)
    e = info.value
    assert isinstance(e.__cause__, msgspec.ValidationError)
    assert e.line == 4
    assert e.error == LineError(
        4, "max_tokens: Expected `int` >= 1 (got 0); set max_tokens to an integer from 1 to 1000000"
    )
    assert str(e) == f"line 4: {e.message}"
    with pytest.raises(InvalidLine) as info:
        parse_line(b'{"prompt": ', 4)
    assert isinstance(info.value.__cause__, msgspec.DecodeError)


@pytest.mark.parametrize(
    ("raw", "substring"),
    [
        ("", "blank line"),
        ('{"prompt": "\ud800"}', "lone surrogate"),
        (b"[" * 100_000, "invalid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", "invalid JSON"),
        (b'{"prompt": "\xc3\xa9t\xc3\xa9"  oops}', "column 19"),  # columns count characters
        (b'{"prompt": "a", "metadata": {"x": 1e999}}', "number out of range"),
    ],
)
def test_parse_line_odd_input(raw, substring):
    with pytest.raises(InvalidLine) as info:
        parse_line(raw, 1)
    assert substring in info.value.message


def test_long_values_are_shortened_in_messages():
    with pytest.raises(InvalidLine) as info:
        parse_line(json.dumps({"prompt": "a", "stop": "x" * 10_000}), 1)
    assert len(info.value.message) < 200
    with pytest.raises(InvalidLine) as info:
        parse_line(json.dumps({"prompt": [*range(100_000), -1]}), 1)
    assert "prompt[100000]: Expected `int` >= 0 (got -1)" in info.value.message


# --------------------------------------------------------------------------------------
# Files: huge lines, skip_invalid, reports, stdin, empty files


def test_huge_line_is_reported_without_decoding(tmp_path):
    p = tmp_path / "huge.jsonl"
    with p.open("wb") as f:
        f.write(b'{"prompt": "before"}\n')
        f.write(b'{"prompt": "' + b"x" * (3 << 20) + b'"}\r\n')
        f.write(b'{"prompt": "after"}\n')
        f.write(b'{"prompt": "' + b"\xff" * 5000 + b'"}')  # over the limit, no newline at EOF
    parsed = read_requests(p, skip_invalid=True, max_line_bytes=4096)
    assert [r.prompt for r in parsed.requests] == ["before", "after"]
    assert parsed.lines == [1, 3]
    assert [e.line for e in parsed.errors] == [2, 4]
    size = len(b'{"prompt": "') + (3 << 20) + len(b'"}')
    assert parsed.errors[0].message.startswith(
        f"line is too long: {size} bytes, over the limit of 4096 bytes (max_line_bytes)"
    )
    assert "5014 bytes" in parsed.errors[1].message
    with pytest.raises(InputFileError, match=r"huge\.jsonl:2: line is too long"):
        read_requests(p, max_line_bytes=4096)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_line_of_exactly_the_limit_is_accepted(tmp_path, ending):
    def line(n: int) -> bytes:
        return b'{"prompt": "' + b"y" * (n - 14) + b'"}'

    p = tmp_path / "limit.jsonl"
    p.write_bytes(line(102) + ending + line(103) + ending + line(102))  # no ending at EOF
    parsed = read_requests(p, skip_invalid=True, max_line_bytes=102)
    assert parsed.lines == [1, 3]
    assert [e.line for e in parsed.errors] == [2]
    assert "103 bytes" in parsed.errors[0].message
    p.write_bytes(line(102) + ending + line(103))
    parsed = read_requests(p, skip_invalid=True, max_line_bytes=102)
    assert parsed.lines == [1]
    assert "103 bytes" in parsed.errors[0].message


def test_parse_lines_max_line_bytes():
    parsed = parse_lines(
        [b'{"prompt": "ok"}', b'{"prompt": "' + b"x" * 100 + b'"}'], max_line_bytes=50
    )
    assert parsed.lines == [1]
    assert parsed.errors[0].line == 2
    assert "too long" in parsed.errors[0].message


def test_mixed_good_and_bad_skip_invalid_both_ways(tmp_path):
    lines = [
        '{"custom_id": "ok1", "prompt": "a"}',
        '{"custom_id": "bad1", "prompt": "a", "top_p": 2}',
        "",
        json.dumps(chat(temperature=0.3)),
        "{nope",
        '{"prompt": [3, 4]}',
    ]
    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputFileError) as info:
        read_requests(p)
    assert [e.line for e in info.value.errors] == [2, 5]
    assert str(info.value).splitlines() == [
        f"{p}:2: top_p: Expected `float` <= 1.0 (got 2); set top_p to a number from 0 to 1 "
        "(1 = off)",
        f"{p}:5: " + info.value.errors[1].message,
    ]
    assert info.value.errors[1].message.startswith("invalid JSON at column 2:")

    parsed = read_requests(p, skip_invalid=True)
    assert [r.custom_id for r in parsed.requests] == ["ok1", "c", "line-6"]
    assert parsed.lines == [1, 4, 6]
    assert [e.line for e in parsed.errors] == [2, 5]


def test_report_is_capped(tmp_path):
    p = tmp_path / "many.jsonl"
    p.write_text('{"prompt": "good"}\n' + "[]\n" * 120)
    with pytest.raises(InputFileError) as info:
        read_requests(p)
    report = str(info.value).splitlines()
    assert len(info.value.errors) == 120
    assert len(report) == 51
    assert report[0] == f"{p}:2: expected a JSON object per line, got an array; " + (
        'write each request as {"prompt": ...} or {"messages": [...]}'
    )
    assert report[49].startswith(f"{p}:51: ")
    assert report[50] == "... and 70 more invalid lines"
    assert str(InputFileError("f", [LineError(1, "x")] * 51)).endswith(
        "... and 1 more invalid line"
    )


@pytest.mark.parametrize("content", [b"", b"\n\n   \n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\n"])
def test_empty_file_is_an_error(tmp_path, content):
    p = tmp_path / "empty.jsonl"
    p.write_bytes(content)
    for skip in (False, True):
        with pytest.raises(InputFileError) as info:
            read_requests(p, skip_invalid=skip)
        assert str(info.value) == f"no requests in {p}"
        assert info.value.errors == []


def test_all_invalid_with_skip_invalid_is_an_error(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("[]\n{}\n")
    with pytest.raises(InputFileError) as info:
        read_requests(p, skip_invalid=True)
    assert str(info.value).splitlines()[-1] == f"no valid requests in {p}"
    assert [e.line for e in info.value.errors] == [1, 2]


def test_reads_stdin_and_file_objects(monkeypatch):
    data = b'\xef\xbb\xbf{"prompt": "from stdin"}\n'
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    parsed = read_requests("-")
    assert [r.prompt for r in parsed.requests] == ["from stdin"]
    with pytest.raises(InputFileError) as info:
        read_requests(io.BytesIO(b"[]\n"))
    assert str(info.value).startswith("<input>:1: ")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    with pytest.raises(InputFileError, match="no requests in <stdin>"):
        read_requests("-")


def test_text_file_objects_work_too():
    parsed = read_requests(io.StringIO('\ufeff{"prompt": "é"}\n{"prompt": "b"}'))
    assert [r.prompt for r in parsed.requests] == ["é", "b"]


def test_parsed_input_shape():
    parsed = parse_lines([b"", b'{"prompt": "a"}', b"oops"])
    assert isinstance(parsed, ParsedInput)
    assert parsed.lines == [2]
    assert [e.line for e in parsed.errors] == [3]


def test_error_messages_name_a_field_or_say_what_is_wrong():
    # A regression guard for the message style: "field: what (got value); how to fix".
    with pytest.raises(InvalidLine) as info:
        request_from_openai(chat(top_p=-0.5), 9)
    assert re.fullmatch(
        r"body\.top_p: Expected `float` >= 0\.0 \(got -0\.5\); set top_p to .*", info.value.message
    )


# --------------------------------------------------------------------------------------
# /v1/responses lines


def responses(**body) -> dict:
    body.setdefault("input", "hi")
    return {"custom_id": "c", "method": "POST", "url": "/v1/responses", "body": body}


def test_responses_lines_become_chat_requests():
    r = request_from_openai(responses(instructions="Be brief", model="m", max_output_tokens=9), 1)
    assert r.messages == [Message("system", "Be brief"), Message("user", "hi")]
    assert (r.model, r.max_tokens, r.metadata) == ("m", 9, {"model": "m"})
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "S"}]},
        {"role": "user", "content": [{"type": "input_text", "text": t} for t in "ab"]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "A", "annotations": []}]},
        {"role": "user", "content": "again"},
    ]  # fmt: skip
    r = request_from_openai(responses(input=items, temperature=0.7, top_p=0.9, seed=3), 2)
    assert r.messages == [
        Message("system", "S"),
        Message("user", "a\nb"),
        Message("assistant", "A"),
        Message("user", "again"),
    ]
    assert (r.temperature, r.top_p, r.seed) == (0.7, 0.9, 3)
    # Harmless fields, as inspect-ai and the SDK send them, change nothing.
    harmless = responses(
        include=["reasoning.encrypted_content"],
        store=False,
        tools=[],
        tool_choice="auto",
        parallel_tool_calls=True,
        truncation="disabled",
        reasoning={"effort": "none"},
        stream=False,
        background=False,
        user="u",
        safety_identifier="s",
        prompt_cache_key="k",
        metadata={"run": "7"},
        text={"format": {"type": "text"}, "verbosity": "medium"},
    )
    r = request_from_openai(harmless, 3)
    assert r.messages == [Message("user", "hi")] and r.metadata == {"run": "7"}
    assert r.response_format is None or type(r.response_format).__name__ == "TextFormat"


def test_responses_text_format_maps_onto_response_format():
    from mlxq.wire import JsonObjectFormat, JsonSchemaFormat, RegexFormat

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    r = request_from_openai(responses(text={"format": fmt}), 1)
    assert isinstance(r.response_format, JsonSchemaFormat)
    spec = r.response_format.json_schema
    assert (spec.name, spec.schema, spec.strict) == ("x", schema, True)
    r = request_from_openai(responses(text={"format": {"type": "json_object"}}), 1)
    assert isinstance(r.response_format, JsonObjectFormat)
    r = request_from_openai(responses(text={"format": {"type": "regex", "pattern": "a+"}}), 1)
    assert isinstance(r.response_format, RegexFormat)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": [{"type": "web_search"}]}, "body.tools: tools are not supported"),
        ({"tool_choice": "required"}, 'body.tool_choice: only "none" or "auto"'),
        ({"previous_response_id": "resp_1"}, "body.previous_response_id: not supported"),
        ({"conversation": "conv_1"}, "body.conversation: not supported"),
        ({"reasoning": {"effort": "low"}}, "body.reasoning: not supported"),
        ({"reasoning": {"summary": "auto"}}, "body.reasoning: not supported"),
        ({"background": True}, "body.background: background responses are not supported"),
        ({"stream": True}, "body.stream: streaming is not supported"),
        ({"include": ["message.output_text.logprobs"]}, "body.include[0]: "),
        ({"truncation": "auto"}, 'body.truncation: only "disabled"'),
        ({"top_logprobs": 2}, "body.top_logprobs: not supported"),
        ({"prompt": {"id": "p"}}, "body.prompt: not supported"),
        ({"input": None}, "body.input: missing"),
        ({"input": []}, "body.input: empty"),
        ({"input": 3}, "body.input: expected text or a list of messages"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         'body.input[0].content[0]: "input_image" content is not supported'),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         'body.input[0].content[0]: "input_file" content is not supported'),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
         "body.input[0].content[0]: unsupported content part"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
         'body.input[0].type: "function_call" items are not supported'),
        ({"input": [{"type": "reasoning", "summary": []}]}, 'body.input[0].type: "reasoning"'),
        ({"input": [{"type": "item_reference", "id": "x"}]}, '"item_reference" items'),
        ({"input": [{"role": "tool", "content": "x"}]}, "body.input[0].role: unsupported role"),
        ({"input": [{"role": "user", "content": "x", "name": "n"}]}, "unsupported field `name`"),
        ({"instructions": ["x"]}, "body.instructions: expected text"),
        ({"max_output_tokens": 0}, "body.max_output_tokens: Expected `int` >= 1"),
        ({"max_tokens": 5}, "`max_tokens` is `max_output_tokens` on /v1/responses"),
        ({"messages": []}, "`messages` is `input` on /v1/responses"),
        ({"response_format": {"type": "json_object"}}, "`response_format` is `text.format`"),
        ({"temperature": 11}, "body.temperature: Expected `float` <= 10.0"),
        ({"text": {"format": {"type": "json_schema"}}}, "body.text.format.schema: missing"),
        ({"text": {"format": {"type": "json_schema", "schema": {}, "json_schema": {}}}},
         "body.text.format: unsupported field `json_schema` for type 'json_schema'"),
        ({"text": {"format": {"type": "xml"}}}, 'body.text.format.type: unsupported "xml"'),
        ({"text": {"verbosity": "low"}}, "body.text.verbosity: not supported"),
        ({"text": {"format": {"type": "regex", "pattern": "(x"}}},
         "body.text.format.pattern: cannot be enforced"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
         "body.text.format.schema: cannot be enforced"),
        ({"user": 3}, "body.user: expected a string"),
    ],
)  # fmt: skip
def test_responses_lines_refuse_what_mlxq_cannot_do_naming_the_field(body, message):
    with pytest.raises(InvalidLine) as e:
        request_from_openai(responses(**body), 4)
    assert e.value.line == 4 and message in e.value.message, e.value.message
    assert "\n" not in e.value.message


def test_embeddings_lines_are_not_supported_yet():
    line = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
    with pytest.raises(InvalidLine, match=r"url: embeddings are not supported yet"):
        request_from_openai(line, 1)
    line["url"] = "/v1/moderations"
    with pytest.raises(InvalidLine, match=r'mlxq supports "/v1/responses", "/v1/chat/completions"'):
        request_from_openai(line, 1)
