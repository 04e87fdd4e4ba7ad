"""mlxq results as OpenAI Batch API output lines.

A request that produced text (``finish_reason`` ``stop`` or ``length``) becomes an output
file line::

    {"id": "batch_req_...", "custom_id": "...", "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": <completion>}}

where the body is a ``chat.completion`` (``/v1/chat/completions``) or ``text_completion``
(``/v1/completions``) object. Anything else becomes an error file line
``{"id", "custom_id", "response": null, "error": {"code", "message"}}``.

Token logprobs are given with each token's id as its ``token`` text: results carry token
ids, and this module does not load a tokenizer.
"""

from __future__ import annotations

import time
from typing import Any

from mlxq.openai_batch import CHAT_URL
from mlxq.types import Result, TokenLogprob

SUCCESS_REASONS = frozenset({"stop", "length"})

# Error codes of the error file, by finish_reason.
_ERROR_CODES = {
    "error": "request_failed",
    "timeout": "request_timeout",
    "cancelled": "batch_cancelled",
    "expired": "batch_expired",
}
ERROR_MESSAGES = {
    "batch_cancelled": "The batch was cancelled before this request completed.",
    "batch_expired": "This request could not be executed before the completion window expired.",
}


def is_success(result: Result) -> bool:
    """Whether the result goes to the output file (else to the error file)."""
    return result.finish_reason in SUCCESS_REASONS


def to_openai_line(
    result: Result, endpoint: str, *, cancelled_code: str = "batch_cancelled"
) -> dict[str, Any]:
    """One OpenAI batch output or error line for ``result``.

    ``endpoint`` (``/v1/chat/completions`` or ``/v1/completions``) picks the response body's
    shape. A ``cancelled`` result is reported with ``cancelled_code`` (``batch_expired``
    when the batch was stopped by its completion window).
    """
    line_id = "batch_req_" + _hex(result.job_id)
    if not is_success(result):
        code = _ERROR_CODES.get(result.finish_reason, "request_failed")
        if result.finish_reason == "cancelled":
            code = cancelled_code
        message = ERROR_MESSAGES.get(code) or result.error or f"{result.finish_reason}"
        return error_line(line_id, result.custom_id, code, message)
    body = chat_body(result) if endpoint.rstrip("/") == CHAT_URL else completion_body(result)
    return {
        "id": line_id,
        "custom_id": result.custom_id,
        "response": {"status_code": 200, "request_id": "req_" + _hex(result.job_id), "body": body},
        "error": None,
    }


def error_line(line_id: str, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error file line."""
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def chat_body(result: Result) -> dict[str, Any]:
    """A ``chat.completion`` object for a finished result."""
    logprobs = None
    if result.logprobs is not None:
        logprobs = {"content": [_chat_logprob(t) for t in result.logprobs], "refusal": None}
    return {
        "id": "chatcmpl-" + _hex(result.job_id),
        "object": "chat.completion",
        "created": _created(result),
        "model": _model(result),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text, "refusal": None},
                "logprobs": logprobs,
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": _usage(result),
        "system_fingerprint": None,
    }


def completion_body(result: Result) -> dict[str, Any]:
    """A ``text_completion`` object for a finished result."""
    logprobs = None
    if result.logprobs is not None:
        logprobs = {
            "tokens": [str(t.token_id) for t in result.logprobs],
            "token_logprobs": [t.logprob for t in result.logprobs],
            "top_logprobs": [{str(a.token_id): a.logprob for a in t.top} for t in result.logprobs],
            "text_offset": None,
        }
    return {
        "id": "cmpl-" + _hex(result.job_id),
        "object": "text_completion",
        "created": _created(result),
        "model": _model(result),
        "choices": [
            {
                "text": result.text,
                "index": 0,
                "logprobs": logprobs,
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": _usage(result),
        "system_fingerprint": None,
    }


def _chat_logprob(t: TokenLogprob) -> dict[str, Any]:
    return {
        "token": str(t.token_id),
        "logprob": t.logprob,
        "bytes": None,
        "top_logprobs": [
            {"token": str(a.token_id), "logprob": a.logprob, "bytes": None} for a in t.top
        ],
    }


def _usage(result: Result) -> dict[str, int]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }


def _model(result: Result) -> str | None:
    """The model that served the request, else the one the request named."""
    named = result.metadata.get("model")
    return result.model or (named if isinstance(named, str) else None)


def _created(result: Result) -> int:
    return int(result.timing.finished_at or time.time())


def _hex(job_id: str) -> str:
    return job_id.replace("-", "")
