"""mlxq results as OpenAI Batch API output and error lines.

Used by ``mlxq results --format openai`` and by the HTTP API's output and error files
(``mlxq.api.finalize``). ``to_openai_line`` turns one ``Result`` into a line of an output
file::

    {"id": "batch_req_...", "custom_id": "...", "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": <completion>}}

with a ``chat.completion`` (``/v1/chat/completions``), ``text_completion``
(``/v1/completions``) or ``response`` (``/v1/responses``: :func:`response_body`) body, or,
for a request that produced no completion, a line of an error file: ``{"id", "custom_id",
"response": null, "error": {"code", "message"}}``. Choices made where mlxq and OpenAI
differ:

* ``finish_reason``: ``stop`` and ``length`` map to themselves. ``timeout`` (the job's
  wall-clock limit cut generation short) maps to ``length``, the reason OpenAI gives for a
  truncated completion, and the partial text is kept; a timeout before any token is an
  error with code ``request_timeout``.
* Error codes: ``error`` → ``request_failed``, ``cancelled`` → ``batch_cancelled`` (or the
  caller's ``cancelled_code``, e.g. ``batch_expired`` for a batch stopped by its window),
  ``expired`` → ``batch_expired``. The two batch codes carry OpenAI's own messages; the
  others the result's ``error``.
* Ids: the job id without dashes (``<hex>``) gives ``batch_req_<hex>``, the request id
  ``req_<hex>`` and the body's ``chatcmpl-<hex>`` / ``cmpl-<hex>`` / ``resp_<hex>`` (its
  message ``msg_<hex>``). ``created`` (``created_at``) is the result's finish time (Unix
  seconds, else its latest earlier timestamp); ``model`` the model the worker served, else
  the one the request named.
* Responses: ``status`` ``completed``, or ``incomplete`` with ``incomplete_details.reason``
  ``max_output_tokens`` where a chat completion's ``finish_reason`` would be ``length``.
  A result keeps no request parameters, so ``instructions``, ``temperature``, ``top_p``
  and ``max_output_tokens`` are null; ``metadata`` is the request's string values (without
  the ``model`` mlxq adds); ``tools`` is empty and ``tool_choice`` ``none``.
* ``n`` > 1: a choice per sample, in order, each with its own ``finish_reason``; a
  sample that ended in error (e.g. its constraint failed) reports ``error`` there.
  ``usage.completion_tokens`` counts every choice's tokens.
* Logprobs: OpenAI's shapes. Chat: ``logprobs.content``, an entry per token with its
  ``token`` text, ``logprob``, UTF-8 ``bytes`` and ``top_logprobs`` (each ``{token,
  logprob, bytes}``); completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a
  ``{token: logprob}`` per token) and ``text_offset`` (characters). A token holding part
  of a multi-byte character has the bytes it holds, and as ``token`` ``bytes:`` and its
  text with the partial character's bytes escaped (``bytes: \\xf0\\x9f``). Results from
  before workers recorded bytes give ``token`` as the id in decimal, ``bytes`` null and
  ``text_offset`` null. Every entry also has a non-standard ``token_id`` (completions:
  ``token_ids``), which clients that follow OpenAI's schema ignore.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from typing import Any

from mlxq.formats.openai_input import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL
from mlxq.wire import Result, TokenLogprob

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL)

FINISH_REASONS = {"stop": "stop", "length": "length", "timeout": "length"}
# Error file codes, by finish_reason.
ERROR_CODES = {
    "error": "request_failed",
    "timeout": "request_timeout",
    "cancelled": "batch_cancelled",
    "expired": "batch_expired",
}
# OpenAI's messages for the codes that the batch's state, not the request, explains.
ERROR_MESSAGES = {
    "batch_cancelled": "The batch was cancelled before this request completed.",
    "batch_expired": "This request could not be executed before the completion window expired.",
}
_FALLBACK_MESSAGES = {
    "request_failed": "The request failed.",
    "request_timeout": "The request reached its time limit before generating any tokens.",
}

# One choice's body fields (message or text, and logprobs) from its text and logprobs.
_Choice = Callable[[str, list[TokenLogprob] | None], dict[str, Any]]


def unsupported_endpoint(endpoint: str) -> str:
    """Why a batch cannot have ``endpoint``, and what mlxq serves."""
    why = "embeddings are not supported yet" if endpoint.rstrip("/") == EMBEDDINGS_URL else None
    served = f"mlxq serves {RESPONSES_URL}, {CHAT_URL} and {COMPLETIONS_URL}"
    return f"Unsupported endpoint {endpoint!r}: " + (f"{why}; {served}" if why else served)


def is_error(result: Result) -> bool:
    """Whether ``result`` goes to the error file (it produced no completion)."""
    if result.finish_reason == "timeout":
        return not (result.text or result.token_ids)
    return result.finish_reason not in FINISH_REASONS


def is_success(result: Result) -> bool:
    """Whether ``result`` goes to the output file: the opposite of ``is_error``."""
    return not is_error(result)


def to_openai_line(
    result: Result,
    endpoint: str = CHAT_URL,
    *,
    cancelled_code: str = "batch_cancelled",
) -> dict[str, Any]:
    """One OpenAI Batch output (or error) line for ``result``, as a JSON-ready dict.

    ``endpoint`` (``/v1/chat/completions``, ``/v1/completions`` or ``/v1/responses``; a
    trailing slash is allowed) picks the body's shape. A ``cancelled`` result is reported with
    ``cancelled_code``.
    """
    make_body = _BODIES.get(endpoint.rstrip("/"))
    if make_body is None:
        raise ValueError(f"unsupported endpoint {endpoint!r}; use one of {', '.join(ENDPOINTS)}")
    line_id = request_line_id(result.job_id)
    if is_error(result):
        return error_line(line_id, result.custom_id, *_error(result, cancelled_code))
    response = {
        "status_code": 200,
        "request_id": "req_" + _hex(result.job_id),
        "body": make_body(result),
    }
    return {"id": line_id, "custom_id": result.custom_id, "response": response, "error": None}


def error_line(line_id: str, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """An error file line."""
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


def chat_body(result: Result) -> dict[str, Any]:
    """A ``chat.completion`` object for a finished result (a choice per sample)."""

    def choice(text: str, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        logprobs = None
        if lps is not None:
            logprobs = {"content": [_chat_logprob(lp) for lp in lps], "refusal": None}
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"message": message, "logprobs": logprobs}

    return _body(result, "chatcmpl-", "chat.completion", choice)


def completion_body(result: Result) -> dict[str, Any]:
    """A ``text_completion`` object for a finished result (a choice per sample)."""

    def choice(text: str, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        return {"text": text, "logprobs": None if lps is None else _completion_logprobs(lps)}

    return _body(result, "cmpl-", "text_completion", choice)


def response_body(result: Result) -> dict[str, Any]:
    """A Responses API ``response`` object for a finished result: an assistant message with
    one ``output_text`` part (a message per sample of a request with ``n`` > 1)."""
    hex_id = _hex(result.job_id)
    output = []
    for i, text, lps, why in _samples(result):
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if lps is not None:
            part["logprobs"] = [_response_logprob(lp) for lp in lps]
        message = {
            "type": "message",
            "id": f"msg_{hex_id}" + (f"_{i}" if i else ""),
            "status": "completed" if why == "stop" else "incomplete",
            "role": "assistant",
            "content": [part],
        }
        output.append(message)
    u = result.usage
    truncated = FINISH_REASONS.get(result.finish_reason) == "length"
    created = _created(result)
    metadata = {k: v for k, v in result.metadata.items() if k != "model" and isinstance(v, str)}
    return {
        "id": "resp_" + hex_id,
        "object": "response",
        "created_at": created,
        "status": "incomplete" if truncated else "completed",
        "completed_at": None if truncated else created,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "instructions": None,
        "max_output_tokens": None,
        "metadata": metadata,
        "model": _model(result),
        "output": output,
        "parallel_tool_calls": False,
        "temperature": None,
        "tool_choice": "none",
        "tools": [],
        "top_p": None,
        "usage": {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens,
        },
    }


_BODIES: dict[str, Callable[[Result], dict[str, Any]]] = {
    CHAT_URL: chat_body,
    COMPLETIONS_URL: completion_body,
    RESPONSES_URL: response_body,
}


def _error(result: Result, cancelled_code: str) -> tuple[str, str]:
    """The (code, message) of an error line."""
    reason = result.finish_reason
    code = cancelled_code if reason == "cancelled" else ERROR_CODES.get(reason, "request_failed")
    fallback = _FALLBACK_MESSAGES.get(code, f"The request ended with {reason!r}.")
    return code, ERROR_MESSAGES.get(code) or result.error or fallback


def _body(result: Result, id_prefix: str, kind: str, choice: _Choice) -> dict[str, Any]:
    """The fields that chat and text completion objects share around their choices: one,
    or one per sample of a request with ``n`` > 1, each with its own finish_reason."""
    choices = [
        {"index": i, **choice(text, lps), "finish_reason": FINISH_REASONS.get(why, why)}
        for i, text, lps, why in _samples(result)
    ]
    return {
        "id": id_prefix + _hex(result.job_id),
        "object": kind,
        "created": _created(result),
        "model": _model(result),
        "choices": choices,
        "usage": _usage(result),
        "system_fingerprint": None,
    }


def _samples(result: Result) -> list[tuple[int, str, list[TokenLogprob] | None, str]]:
    """``(index, text, logprobs, finish_reason)`` of each sample: one, or one per choice."""
    if result.choices:
        return [(c.index, c.text, c.logprobs, c.finish_reason) for c in result.choices]
    return [(0, result.text, result.logprobs, result.finish_reason)]


def token_text(raw: list[int]) -> str:
    """A token's ``token`` string from its UTF-8 bytes: their text, or where they hold part
    of a character, ``bytes:`` and the text with the bytes that do not decode escaped."""
    data = bytes(raw)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + data.decode("utf-8", "backslashreplace")


def _token(token_id: int, raw: list[int] | None) -> str:
    """A token's text, or its id in decimal where its bytes are unknown."""
    return str(token_id) if raw is None else token_text(raw)


def _alternatives(lp: TokenLogprob) -> list[tuple[int, float, list[int] | None]]:
    """``(token_id, logprob, bytes)`` of each top alternative (bytes None where unknown)."""
    raws = lp.top_bytes if lp.top_bytes is not None else [None] * len(lp.top)
    return [(t.token_id, t.logprob, raw) for t, raw in zip(lp.top, raws, strict=True)]


def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    """One entry of a chat choice's ``logprobs.content``."""
    top = [
        {"token": _token(i, raw), "token_id": i, "logprob": value, "bytes": raw}
        for i, value, raw in _alternatives(lp)
    ]
    return {
        "token": _token(lp.token_id, lp.bytes),
        "token_id": lp.token_id,
        "logprob": lp.logprob,
        "bytes": lp.bytes,
        "top_logprobs": top,
    }


def _response_logprob(lp: TokenLogprob) -> dict[str, Any]:
    """One entry of an ``output_text`` part's ``logprobs`` (bytes empty where unknown)."""
    top = [
        {"token": _token(i, raw), "logprob": value, "bytes": raw or []}
        for i, value, raw in _alternatives(lp)
    ]
    token = _token(lp.token_id, lp.bytes)
    return {"token": token, "logprob": lp.logprob, "bytes": lp.bytes or [], "top_logprobs": top}


def _completion_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
    raws = [lp.bytes for lp in logprobs]
    return {
        "tokens": [_token(lp.token_id, lp.bytes) for lp in logprobs],
        "token_ids": [lp.token_id for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            {_token(i, raw): value for i, value, raw in _alternatives(lp)} for lp in logprobs
        ],
        "text_offset": None if None in raws else _text_offsets(raws),
    }


def _text_offsets(raws: list[list[int]]) -> list[int]:
    """Where each token starts in the text, in characters: a token that ends inside a
    character counts it only once the character is complete."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offsets, pos = [], 0
    for raw in raws:
        offsets.append(pos)
        pos += len(decoder.decode(bytes(raw)))
    return offsets


def _usage(result: Result) -> dict[str, int]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }


def _model(result: Result) -> str:
    """The model that served the request, else the one the request named, else ``""``."""
    named = result.metadata.get("model")
    return result.model or (named if isinstance(named, str) else "")


def _created(result: Result) -> int:
    """The finish time, else the latest earlier timestamp, else now (Unix seconds)."""
    t = result.timing
    stamp = t.finished_at or t.first_token_at or t.started_at or t.enqueued_at
    return int(stamp if stamp is not None else time.time())


def request_line_id(job_id: str) -> str:
    """The ``id`` of a job's line in an OpenAI Batch output or error file."""
    return "batch_req_" + _hex(job_id)


def _hex(job_id: str) -> str:
    """A job id as OpenAI-style ids use it: without dashes."""
    return job_id.replace("-", "")
