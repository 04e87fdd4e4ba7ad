"""Result formats for ``mlxq results --format``: mlxq's own lines, or OpenAI Batch output.

``to_openai_line`` turns one ``Result`` into a line of an OpenAI Batch API output file
(``/v1/chat/completions`` or ``/v1/completions`` bodies), or of its error file for jobs
that produced no completion. Choices made where mlxq and OpenAI differ:

* ``finish_reason``: ``stop`` and ``length`` map to themselves; ``timeout`` (the job's
  wall-clock limit cut generation short) maps to ``length``, the reason OpenAI gives for
  a truncated completion, and the partial text is kept.
* ``error``, ``cancelled`` and ``expired`` results become error-file lines
  (``"response": null``) with the codes ``request_failed``, ``batch_cancelled`` and
  ``batch_expired`` (the last two are the codes OpenAI uses for the same situations).
* ``id`` is ``batch_req_<job_id>``, ``request_id`` the job id, the body's ``id``
  ``chatcmpl-<job_id>`` / ``cmpl-<job_id>``, ``created`` the result's finish time (Unix
  seconds), ``model`` the model the worker served.
* Logprobs: results carry token ids, not token text. Pass ``token_text`` (e.g. a
  tokenizer's single-token decode) to get real ``token`` strings and their UTF-8
  ``bytes``; without it ``token`` is the id as a decimal string and ``bytes`` is null.
  Either way every entry also has a non-standard ``token_id`` field (clients that follow
  OpenAI's schema ignore unknown fields).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mlxq.types import Result, TokenLogprob

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)

FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "length"}
ERROR_CODES = {
    "error": "request_failed",
    "cancelled": "batch_cancelled",
    "expired": "batch_expired",
}
_DEFAULT_MESSAGES = {
    "error": "the request failed",
    "cancelled": "the request was cancelled before it finished",
    "expired": "the request expired before it could run",
}

TokenText = Callable[[int], str]


def is_error(result: Result) -> bool:
    """Whether ``result`` goes to the error file (no completion was produced)."""
    return result.finish_reason in ERROR_CODES


def to_openai_line(
    result: Result,
    endpoint: str = CHAT_ENDPOINT,
    *,
    token_text: TokenText | None = None,
) -> dict[str, Any]:
    """One OpenAI Batch output (or error) line for ``result``, as a JSON-ready dict."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unsupported endpoint {endpoint!r}; use one of {', '.join(ENDPOINTS)}")
    line_id = f"batch_req_{result.job_id}"
    if is_error(result):
        return {
            "id": line_id,
            "custom_id": result.custom_id,
            "response": None,
            "error": {
                "code": ERROR_CODES[result.finish_reason],
                "message": result.error or _DEFAULT_MESSAGES[result.finish_reason],
            },
        }
    if endpoint == CHAT_ENDPOINT:
        body = _chat_body(result, token_text)
    else:
        body = _completion_body(result, token_text)
    return {
        "id": line_id,
        "custom_id": result.custom_id,
        "response": {"status_code": 200, "request_id": result.job_id, "body": body},
        "error": None,
    }


def _created(result: Result) -> int:
    t = result.timing
    stamp = t.finished_at or t.first_token_at or t.started_at or t.enqueued_at
    return int(stamp if stamp is not None else time.time())


def _usage(result: Result) -> dict[str, int]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }


def _chat_body(result: Result, token_text: TokenText | None) -> dict[str, Any]:
    logprobs = None
    if result.logprobs is not None:
        logprobs = {"content": [_chat_logprob(lp, token_text) for lp in result.logprobs]}
        logprobs["refusal"] = None
    return {
        "id": f"chatcmpl-{result.job_id}",
        "object": "chat.completion",
        "created": _created(result),
        "model": result.model or "",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text, "refusal": None},
                "logprobs": logprobs,
                "finish_reason": FINISH_REASONS[result.finish_reason],
            }
        ],
        "usage": _usage(result),
        "system_fingerprint": None,
    }


def _token(token_id: int, token_text: TokenText | None) -> tuple[str, list[int] | None]:
    if token_text is None:
        return str(token_id), None
    text = token_text(token_id)
    return text, list(text.encode("utf-8"))


def _chat_logprob(lp: TokenLogprob, token_text: TokenText | None) -> dict[str, Any]:
    token, raw = _token(lp.token_id, token_text)
    top = []
    for alt in lp.top:
        alt_token, alt_raw = _token(alt.token_id, token_text)
        top.append(
            {"token": alt_token, "token_id": alt.token_id, "logprob": alt.logprob, "bytes": alt_raw}
        )
    return {
        "token": token,
        "token_id": lp.token_id,
        "logprob": lp.logprob,
        "bytes": raw,
        "top_logprobs": top,
    }


def _completion_logprobs(
    logprobs: list[TokenLogprob], token_text: TokenText | None
) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
    tokens = [_token(lp.token_id, token_text)[0] for lp in logprobs]
    offsets = None
    if token_text is not None:
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
    return {
        "tokens": tokens,
        "token_ids": [lp.token_id for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            {_token(alt.token_id, token_text)[0]: alt.logprob for alt in lp.top} for lp in logprobs
        ],
        "text_offset": offsets,
    }


def _completion_body(result: Result, token_text: TokenText | None) -> dict[str, Any]:
    logprobs = None
    if result.logprobs is not None:
        logprobs = _completion_logprobs(result.logprobs, token_text)
    return {
        "id": f"cmpl-{result.job_id}",
        "object": "text_completion",
        "created": _created(result),
        "model": result.model or "",
        "choices": [
            {
                "index": 0,
                "text": result.text,
                "logprobs": logprobs,
                "finish_reason": FINISH_REASONS[result.finish_reason],
            }
        ],
        "usage": _usage(result),
        "system_fingerprint": None,
    }
