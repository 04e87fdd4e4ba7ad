"""OpenAI Batch output lines from mlxq results."""

from __future__ import annotations

import json

import pytest

from mlxq.formats.openai_output import (
    ERROR_MESSAGES,
    error_line,
    is_error,
    is_success,
    to_openai_line,
)
from mlxq.wire import (
    Choice,
    Result,
    Timing,
    TokenLogprob,
    TopLogprob,
    Usage,
    json_encoder,
    result_decoder,
)

# docs/formats.md's example result, as a worker stores it.
README_RESULT = b"""{"job_id": "9f1c", "custom_id": "a1", "finish_reason": "length",
 "text": "Rain on the roof", "token_ids": [791, 1234, 56, 78],
 "usage": {"prompt_tokens": 14, "completion_tokens": 4, "total_tokens": 18},
 "logprobs": null, "error": null, "model": "mlx-community/Llama-3.2-3B-Instruct-4bit",
 "worker": "studio-1", "batch_id": "b3f", "index": 0, "metadata": {},
 "timing": {"enqueued_at": 1764450000.1, "started_at": 1764450002.3,
            "first_token_at": 1764450002.5, "finished_at": 1764450004.0,
            "queue_wait_s": 2.2, "ttft_s": 0.2, "prefill_tps": 870.5, "decode_tps": 41.3}}"""


def test_chat_completion_line():
    line = to_openai_line(result_decoder.decode(README_RESULT))
    assert json.loads(json.dumps(line)) == line  # plain JSON values only
    assert line["id"] == "batch_req_9f1c" and line["custom_id"] == "a1"
    assert line["error"] is None
    response = line["response"]
    assert response["status_code"] == 200 and response["request_id"] == "req_9f1c"
    body = response["body"]
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-9f1c"
    assert body["created"] == 1764450004
    assert body["model"] == "mlx-community/Llama-3.2-3B-Instruct-4bit"
    assert body["usage"] == {"prompt_tokens": 14, "completion_tokens": 4, "total_tokens": 18}
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "Rain on the roof"
    assert choice["logprobs"] is None


def test_completions_line():
    result = result_decoder.decode(README_RESULT)
    line = to_openai_line(result, "/v1/completions")
    body = line["response"]["body"]
    assert body["object"] == "text_completion" and body["id"] == "cmpl-9f1c"
    (choice,) = body["choices"]
    assert choice["text"] == "Rain on the roof" and choice["finish_reason"] == "length"
    assert "message" not in choice and choice["logprobs"] is None


def test_ids_drop_the_job_ids_dashes():
    result = Result(job_id="1a-2b-3c", custom_id="c", finish_reason="stop")
    chat = to_openai_line(result)
    assert chat["id"] == "batch_req_1a2b3c" and chat["response"]["request_id"] == "req_1a2b3c"
    assert chat["response"]["body"]["id"] == "chatcmpl-1a2b3c"
    assert to_openai_line(result, "/v1/completions")["response"]["body"]["id"] == "cmpl-1a2b3c"
    failed = to_openai_line(Result(job_id="1a-2b", custom_id="c", finish_reason="error"))
    assert failed["id"] == "batch_req_1a2b"


@pytest.mark.parametrize(
    ("ours", "theirs"), [("stop", "stop"), ("length", "length"), ("timeout", "length")]
)
def test_finish_reasons(ours, theirs):
    result = Result(job_id="j", custom_id="c", finish_reason=ours, text="partial")
    assert not is_error(result) and is_success(result)
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        choice = to_openai_line(result, endpoint)["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == theirs


@pytest.mark.parametrize(
    ("reason", "code", "message"),
    [
        ("error", "request_failed", "it broke"),
        ("timeout", "request_timeout", "it broke"),
        ("cancelled", "batch_cancelled", ERROR_MESSAGES["batch_cancelled"]),
        ("expired", "batch_expired", ERROR_MESSAGES["batch_expired"]),
    ],
)
def test_failed_results_take_the_error_file_form(reason, code, message):
    result = Result(job_id="j9", custom_id="c9", finish_reason=reason, error="it broke")
    assert is_error(result) and not is_success(result)
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        line = to_openai_line(result, endpoint)
        assert line == error_line("batch_req_j9", "c9", code, message)
        assert line == {
            "id": "batch_req_j9",
            "custom_id": "c9",
            "response": None,
            "error": {"code": code, "message": message},
        }


@pytest.mark.parametrize("reason", ["error", "timeout", "cancelled", "expired"])
def test_error_lines_always_have_a_message(reason):
    line = to_openai_line(Result(job_id="j", custom_id=None, finish_reason=reason))
    assert line["custom_id"] is None and line["error"]["message"]


def test_a_timeout_keeps_its_partial_completion():
    tokens = Result(job_id="j", custom_id="c", finish_reason="timeout", token_ids=[7])
    assert is_success(tokens)
    body = to_openai_line(tokens, "/v1/completions")["response"]["body"]
    assert body["choices"][0]["finish_reason"] == "length"


def test_cancelled_code_names_why_a_batch_stopped():
    result = Result(job_id="j", custom_id="c", finish_reason="cancelled", error="cancelled")
    line = to_openai_line(result, "/v1/chat/completions", cancelled_code="batch_expired")
    assert line["error"] == {"code": "batch_expired", "message": ERROR_MESSAGES["batch_expired"]}
    expired = Result(job_id="j", custom_id="c", finish_reason="expired")
    assert to_openai_line(expired, cancelled_code="x")["error"]["code"] == "batch_expired"


def with_logprobs() -> Result:
    return Result(
        job_id="j",
        custom_id="c",
        finish_reason="stop",
        text="Hi!",
        token_ids=[10, 11],
        usage=Usage(3, 2, 5),
        logprobs=[
            TokenLogprob(10, -0.1, [TopLogprob(10, -0.1), TopLogprob(12, -2.5)]),
            TokenLogprob(11, -0.7, []),
        ],
        timing=Timing(finished_at=5.9),
    )


def test_chat_logprobs_stored_without_bytes_use_token_ids():
    choice = to_openai_line(with_logprobs())["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert content[0] == {
        "token": "10",
        "token_id": 10,
        "logprob": -0.1,
        "bytes": None,
        "top_logprobs": [
            {"token": "10", "token_id": 10, "logprob": -0.1, "bytes": None},
            {"token": "12", "token_id": 12, "logprob": -2.5, "bytes": None},
        ],
    }
    assert content[1]["top_logprobs"] == [] and content[1]["logprob"] == -0.7


def with_bytes() -> Result:
    """``with_logprobs`` as a worker stores it now: each token's UTF-8 bytes recorded. The
    second token is the first half of "é" (0xC3 0xA9); the alternative the other half."""
    result = with_logprobs()
    result.text = "Hié"
    result.token_ids = [10, 11, 13]
    hi, half, rest = list(b"Hi"), [0xC3], [0xA9]
    result.logprobs = [
        TokenLogprob(10, -0.1, [TopLogprob(10, -0.1), TopLogprob(12, -2.5)], hi, [hi, list(b"\t")]),
        TokenLogprob(11, -0.7, [TopLogprob(11, -0.7)], half, [half]),
        TokenLogprob(13, -0.2, [], rest, []),
    ]
    return result


def test_chat_logprobs_name_tokens_by_their_stored_bytes():
    line = to_openai_line(result_decoder.decode(json_encoder.encode(with_bytes())))
    content = line["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hi", "bytes:\\xc3", "bytes:\\xa9"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "Hié"
    assert content[0]["top_logprobs"][1] == {
        "token": "\t",
        "token_id": 12,
        "logprob": -2.5,
        "bytes": [9],
    }
    assert content[1]["top_logprobs"] == [
        {"token": "bytes:\\xc3", "token_id": 11, "logprob": -0.7, "bytes": [0xC3]}
    ]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_logprobs_parse_as_the_openai_sdk_s_types(endpoint):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    body = to_openai_line(with_bytes(), endpoint)["response"]["body"]
    if endpoint == "/v1/completions":
        parsed = Completion.model_validate(body).choices[0].logprobs
        assert parsed.tokens == ["Hi", "bytes:\\xc3", "bytes:\\xa9"]
        assert parsed.top_logprobs[0] == {"Hi": -0.1, "\t": -2.5}
        return
    content = ChatCompletion.model_validate(body).choices[0].logprobs.content
    assert [c.token for c in content] == ["Hi", "bytes:\\xc3", "bytes:\\xa9"]
    assert [c.bytes for c in content] == [[72, 105], [0xC3], [0xA9]]
    assert [(t.token, t.bytes) for t in content[0].top_logprobs] == [("Hi", [72, 105]), ("\t", [9])]


def test_completion_logprobs_legacy_shape():
    choice = to_openai_line(with_bytes(), "/v1/completions")["response"]["body"]["choices"][0]
    assert choice["logprobs"] == {
        "tokens": ["Hi", "bytes:\\xc3", "bytes:\\xa9"],
        "token_ids": [10, 11, 13],
        "token_logprobs": [-0.1, -0.7, -0.2],
        "top_logprobs": [{"Hi": -0.1, "\t": -2.5}, {"bytes:\\xc3": -0.7}, {}],
        "text_offset": [0, 2, 2],  # "é" starts at character 2, complete after its 2nd byte
    }
    plain = to_openai_line(with_logprobs(), "/v1/completions")["response"]["body"]
    assert plain["choices"][0]["logprobs"]["tokens"] == ["10", "11"]
    assert plain["choices"][0]["logprobs"]["text_offset"] is None
    assert plain["choices"][0]["logprobs"]["top_logprobs"] == [{"10": -0.1, "12": -2.5}, {}]
    assert plain["usage"]["total_tokens"] == 5


def test_created_falls_back_to_other_timestamps():
    r = Result(job_id="j", custom_id="c", finish_reason="stop", timing=Timing(enqueued_at=77.7))
    assert to_openai_line(r)["response"]["body"]["created"] == 77
    r = Result(job_id="j", custom_id="c", finish_reason="stop")
    assert to_openai_line(r)["response"]["body"]["created"] > 1_700_000_000


def test_model_falls_back_to_the_requested_one():
    served = Result(job_id="j", custom_id="c", finish_reason="stop", model="m", metadata={})
    named = Result(job_id="j", custom_id="c", finish_reason="stop", metadata={"model": "asked"})
    nothing = Result(job_id="j", custom_id="c", finish_reason="stop", metadata={"model": 3})
    models = [to_openai_line(r)["response"]["body"]["model"] for r in (served, named, nothing)]
    assert models == ["m", "asked", ""]


def test_endpoints():
    r = Result(job_id="j", custom_id="c", finish_reason="stop")
    assert to_openai_line(r, "/v1/completions/")["response"]["body"]["object"] == "text_completion"
    with pytest.raises(ValueError, match="/v1/embeddings"):
        to_openai_line(r, "/v1/embeddings")


def sampled_result() -> Result:
    """A request of n = 3 as a worker stores it: choice 0's output at the top."""
    lp = [TokenLogprob(5, -0.1, [TopLogprob(5, -0.1)])]
    choices = [
        Choice(0, "stop", "yes", [5], lp),
        Choice(1, "length", "no no", [6, 6], lp + lp),
        Choice(2, "error", "", [], None),
    ]
    return Result(
        job_id="ab-cd",
        custom_id="s",
        finish_reason="stop",
        text="yes",
        token_ids=[5],
        usage=Usage(4, 3, 7),
        choices=choices,
    )


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_samples_are_openai_choices(endpoint):
    result = result_decoder.decode(json_encoder.encode(sampled_result()))  # as stored
    body = to_openai_line(result, endpoint)["response"]["body"]
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["finish_reason"] for c in choices] == ["stop", "length", "error"]
    texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
    assert texts == ["yes", "no no", ""]
    assert choices[2]["logprobs"] is None and choices[1]["logprobs"] is not None
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_one_sample_has_no_choices_field_to_read():
    result = result_decoder.decode(README_RESULT)
    assert result.choices is None  # results stored before `n` existed still decode
    assert json.loads(json_encoder.encode(result))["choices"] is None


# -- /v1/responses -------------------------------------------------------------------------


def test_responses_line_parses_as_the_openai_sdk_s_response():
    from openai.types.responses import Response

    result = result_decoder.decode(README_RESULT)  # finish_reason "length"
    result.metadata = {"model": "asked", "run": "7", "input": {"a": 1}}
    line = to_openai_line(result, "/v1/responses")
    assert json.loads(json.dumps(line)) == line
    assert line["response"]["request_id"] == "req_9f1c" and line["error"] is None
    body = line["response"]["body"]
    response = Response.model_validate(body)
    assert (response.id, response.object, response.created_at) == (
        "resp_9f1c",
        "response",
        1764450004,
    )
    assert response.output_text == "Rain on the roof"
    assert response.status == "incomplete" and response.completed_at is None
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert (message.type, message.id, message.role, message.status) == (
        "message",
        "msg_9f1c",
        "assistant",
        "incomplete",
    )
    assert body["output"][0]["content"] == [
        {"type": "output_text", "text": "Rain on the roof", "annotations": []}
    ]
    assert response.model == "mlx-community/Llama-3.2-3B-Instruct-4bit"
    assert response.metadata == {"run": "7"}  # strings only, without mlxq's model
    assert body["usage"] == {
        "input_tokens": 14,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 18,
    }
    assert (response.tools, response.tool_choice, response.parallel_tool_calls) == (
        [],
        "none",
        False,
    )


@pytest.mark.parametrize(
    ("reason", "status"),
    [("stop", "completed"), ("length", "incomplete"), ("timeout", "incomplete")],
)
def test_responses_status_follows_the_finish_reason(reason, status):
    r = Result(
        job_id="j", custom_id="c", finish_reason=reason, text="x", timing=Timing(finished_at=5)
    )
    body = to_openai_line(r, "/v1/responses/")["response"]["body"]
    assert body["status"] == status and body["output"][0]["status"] == status
    assert (body["incomplete_details"] is None) == (status == "completed")
    assert body["completed_at"] == (5 if status == "completed" else None)


def test_responses_errors_take_the_error_file_form():
    r = Result(job_id="j", custom_id="c", finish_reason="error", error="boom")
    assert to_openai_line(r, "/v1/responses") == error_line(
        "batch_req_j", "c", "request_failed", "boom"
    )


def test_responses_samples_and_logprobs_parse_as_the_sdk_s_types():
    from openai.types.responses import Response

    response = Response.model_validate(
        to_openai_line(sampled_result(), "/v1/responses")["response"]["body"]
    )
    assert [m.id for m in response.output] == ["msg_abcd", "msg_abcd_1", "msg_abcd_2"]
    assert [m.status for m in response.output] == ["completed", "incomplete", "incomplete"]
    assert response.status == "completed"  # choice 0's
    logprobs = response.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob, lp.bytes) for lp in logprobs] == [("5", -0.1, [])]
    with_text = Response.model_validate(
        to_openai_line(with_bytes(), "/v1/responses")["response"]["body"]
    )
    first = with_text.output[0].content[0].logprobs[0]
    assert (first.token, first.bytes) == ("Hi", [72, 105])
    assert [(t.token, t.bytes) for t in first.top_logprobs] == [("Hi", [72, 105]), ("\t", [9])]


def test_unsupported_endpoint_names_what_is_served():
    from mlxq.formats.openai_output import ENDPOINTS, unsupported_endpoint

    assert ENDPOINTS == ("/v1/chat/completions", "/v1/completions", "/v1/responses")
    assert unsupported_endpoint("/v1/embeddings") == (
        "Unsupported endpoint '/v1/embeddings': embeddings are not supported yet; mlxq "
        "serves /v1/responses, /v1/chat/completions and /v1/completions"
    )
    assert "serves /v1/responses" in unsupported_endpoint("/v1/moderations")
