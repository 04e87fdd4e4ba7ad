"""OpenAI Batch API input lines, mapped onto mlxq requests.

A line ``{"custom_id", "method": "POST", "url", "body"}`` for ``/v1/chat/completions``,
``/v1/completions`` or ``/v1/responses`` (its body: :mod:`mlxq.formats.openai_responses`)
becomes a :class:`~mlxq.wire.Request` (see :func:`request_from_openai`), so existing batch
files run unchanged. Anything mlxq cannot honour is refused with an
:class:`~mlxq.formats.input_errors.InvalidLine` rather than ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from mlxq.engine.constraints.grammar import constraint_problem
from mlxq.formats import openai_responses as responses
from mlxq.formats.input_errors import InvalidLine, explain, fields_named, show
from mlxq.formats.openai_responses import EMBEDDINGS_URL, RESPONSES_URL
from mlxq.wire import Request

__all__ = [
    "CHAT_URL",
    "COMPLETIONS_URL",
    "EMBEDDINGS_URL",
    "RESPONSES_URL",
    "is_openai_line",
    "request_from_openai",
]

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

# Keys that mark a line as an OpenAI Batch API line rather than an mlxq Request.
_OPENAI_KEYS = frozenset({"method", "url", "body"})
_OPENAI_ENVELOPE = ("custom_id", "method", "url", "body")
_ENDPOINTS = f'"{RESPONSES_URL}", "{CHAT_URL}" and "{COMPLETIONS_URL}"'

_COMMON_BODY = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "n",
    "stream",
    "user",
    "frequency_penalty",
    "presence_penalty",
    "metadata",
    "response_format",
    # mlxq extras
    "top_k",
    "min_p",
    "repetition_penalty",
)
_BODY_FIELDS = {
    CHAT_URL: ("messages", "max_completion_tokens", "logprobs", "top_logprobs", *_COMMON_BODY),
    COMPLETIONS_URL: ("prompt", "logprobs", "echo", "best_of", *_COMMON_BODY),
    RESPONSES_URL: responses.BODY_FIELDS,
}
# Body fields passed to Request unchanged (its constraints check them).
_PASSTHROUGH = (
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "response_format",
    "n",
)
_Fail = Callable[[str], InvalidLine]
_MEDIA_PARTS = frozenset(
    {"image_url", "input_image", "image", "input_audio", "audio", "file", "video", "video_url"}
)


def is_openai_line(obj: dict[str, Any]) -> bool:
    """Whether a decoded line is meant as an OpenAI batch line (it has method, url or body)."""
    return not _OPENAI_KEYS.isdisjoint(obj)


def request_from_openai(obj: dict[str, Any], line: int) -> Request:
    """Map one OpenAI Batch API line (``custom_id``, ``method``, ``url``, ``body``) to a Request.

    ``url`` is ``/v1/chat/completions``, ``/v1/completions`` or ``/v1/responses`` (whose
    body :func:`~mlxq.formats.openai_responses.responses_fields` maps). In ``body``, a null value
    is the same as leaving the field out; ``model`` routes the request to that model's queue
    (and is copied to ``metadata["model"]``);
    ``user`` is ignored; mlxq's ``top_k``, ``min_p`` and ``repetition_penalty`` are
    accepted; ``n`` asks for that many samples (up to :data:`~mlxq.wire.MAX_SAMPLES`);
    anything mlxq cannot honour (``best_of``, ``stream``, non-zero frequency or
    presence penalties, images, several prompts, tools...) is an error, as is any unknown
    field. Chat content given as a list of text parts is joined with newlines.
    """

    def fail(msg: str) -> InvalidLine:
        return InvalidLine(line, msg)

    url, body = _envelope(obj, fail)
    chat = url == CHAT_URL
    body = _body(body, url, fail)
    _refuse_unsupported(body, fail)
    d: dict[str, Any] = {"custom_id": obj["custom_id"]}
    renames: dict[str, str] = {}
    metadata = _metadata(body, fail)
    if metadata:
        d["metadata"] = metadata
    if "model" in body:  # (a string: checked with the metadata)
        d["model"] = body["model"]
    if url == RESPONSES_URL:
        return _convert(d, responses.responses_fields(body, d, fail), fail, url)
    if chat:
        d["messages"] = _openai_messages(body.get("messages"), fail)
    else:
        d["prompt"] = _openai_prompt(body.get("prompt"), fail)
    _max_tokens(body, chat, d, renames, fail)
    for k in _PASSTHROUGH:
        if k in body:
            d[k] = body[k]
    if "stop" in body:
        stop = body["stop"]
        d["stop"] = [stop] if isinstance(stop, str) else stop
    _logprobs(body, chat, d, renames, fail)
    return _convert(d, renames, fail, url)


def _convert(d: dict[str, Any], renames: dict[str, str], fail: _Fail, url: str) -> Request:
    """The Request of fields ``d``, its constraint checked (``renames``: Request field →
    the body's name, for messages)."""
    try:
        req = msgspec.convert(d, Request)
    except msgspec.ValidationError as e:
        raise fail(explain(e, d, renames=renames, prefix="body.")) from e
    if req.response_format is not None and (problem := constraint_problem(req.response_format)):
        if url == RESPONSES_URL:
            raise fail(responses.response_format_problem(problem))
        raise fail(f"body.{problem}")
    return req


def _envelope(obj: dict[str, Any], fail: _Fail) -> tuple[str, Any]:
    """Check the line around the body; return its endpoint (no trailing ``/``) and body."""
    unknown = [k for k in obj if k not in _OPENAI_ENVELOPE]
    if unknown:
        raise fail(
            f"unknown {fields_named(unknown)} in an OpenAI batch line: it has only "
            "custom_id, method, url and body (request parameters go in body)"
        )
    if obj.get("custom_id") is None:
        raise fail("custom_id: missing; OpenAI batch lines need a unique custom_id string")
    method = obj.get("method")
    if method is None:
        raise fail('method: missing; OpenAI batch lines need "method": "POST"')
    if not isinstance(method, str) or method.upper() != "POST":
        raise fail(f'method: only "POST" is supported (got {show(method)})')
    url = obj.get("url")
    if url is None:
        raise fail(f"url: missing; mlxq supports {_ENDPOINTS}")
    if isinstance(url, str) and url.rstrip("/") == EMBEDDINGS_URL:
        raise fail(f"url: embeddings are not supported yet ({url}); mlxq supports {_ENDPOINTS}")
    if not isinstance(url, str) or url.rstrip("/") not in _BODY_FIELDS:
        raise fail(f"url: unsupported endpoint {show(url)}; mlxq supports {_ENDPOINTS}")
    url = url.rstrip("/")
    body = obj.get("body")
    if body is None:
        raise fail(f"body: missing; put the {url} request parameters in body")
    if not isinstance(body, dict):
        raise fail(f"body: expected a JSON object (got {show(body)})")
    return url, body


def _body(body: dict[str, Any], url: str, fail: _Fail) -> dict[str, Any]:
    """The body without its null fields (null is "not given", as in OpenAI's API), checked
    to have only fields that ``url`` takes."""
    body = {k: v for k, v in body.items() if v is not None}
    if url == RESPONSES_URL:
        responses.refuse_unsupported(body, fail)
    supported = _BODY_FIELDS[url]
    unknown = [k for k in body if k not in supported]
    if unknown:
        msg = f"body: unsupported {fields_named(unknown)} for {url}"
        if url == RESPONSES_URL:
            msg += responses.unknown_field_hint(unknown)
        elif url == CHAT_URL and "prompt" in unknown:
            msg += f" (chat requests take `messages`; `prompt` is for {COMPLETIONS_URL})"
        elif url != CHAT_URL and "messages" in unknown:
            msg += f" (`messages` is for {CHAT_URL})"
        raise fail(f"{msg}; supported: {', '.join(supported)}")
    return body


def _refuse_unsupported(body: dict[str, Any], fail: _Fail) -> None:
    """Things mlxq cannot do: refuse rather than silently do something else."""
    for k in ("frequency_penalty", "presence_penalty"):
        v = body.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int | float) or v != 0:
            raise fail(
                f"body.{k}: not supported (got {show(v)}); remove it or set it to 0, "
                "and use repetition_penalty (e.g. 1.1) to discourage repetition"
            )
    if body.get("stream", False) is not False:
        raise fail(
            f"body.stream: streaming is not supported in batches (got {show(body['stream'])});"
            " remove it or set it to false"
        )
    if body.get("echo", False) is not False:
        raise fail(f"body.echo: not supported (got {show(body['echo'])}); remove it")
    best_of = body.get("best_of", 1)
    if type(best_of) is not int or best_of != 1:
        raise fail(f"body.best_of: only 1 is supported (got {show(best_of)}); remove it")


def _metadata(body: dict[str, Any], fail: _Fail) -> dict[str, Any]:
    """The request's metadata: the body's, plus ``model`` when given."""
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict):
        raise fail(f"body.metadata: expected a JSON object (got {show(metadata)})")
    metadata = dict(metadata)
    if "model" in body:
        if not isinstance(body["model"], str):
            raise fail(f"body.model: expected a string (got {show(body['model'])})")
        metadata["model"] = body["model"]
    return metadata


def _max_tokens(
    body: dict[str, Any], chat: bool, d: dict[str, Any], renames: dict[str, str], fail: _Fail
) -> None:
    """Set ``d["max_tokens"]`` from max_tokens or (chat) max_completion_tokens."""
    mt = body.get("max_tokens")
    mct = body.get("max_completion_tokens") if chat else None
    if mt is not None and mct is not None and mt != mct:
        raise fail(
            "body: max_tokens and max_completion_tokens differ "
            f"({show(mt)} and {show(mct)}); give only one"
        )
    if mct is not None:
        d["max_tokens"] = mct
        renames["max_tokens"] = "max_completion_tokens"
    elif mt is not None:
        d["max_tokens"] = mt


def _logprobs(
    body: dict[str, Any], chat: bool, d: dict[str, Any], renames: dict[str, str], fail: _Fail
) -> None:
    """Set ``d["logprobs"]``: chat's logprobs flag and top_logprobs count, or completions'
    logprobs count as it is."""
    if not chat:
        if "logprobs" in body:
            d["logprobs"] = body["logprobs"]
        return
    logprobs = body.get("logprobs", False)
    top = body.get("top_logprobs")
    if not isinstance(logprobs, bool):
        raise fail(
            f"body.logprobs: expected true or false for {CHAT_URL} (got {show(logprobs)}); "
            'set "logprobs": true and "top_logprobs" to the number of alternatives'
        )
    if top is not None and not logprobs:
        raise fail('body.top_logprobs: needs "logprobs": true; set it, or drop top_logprobs')
    if logprobs:
        d["logprobs"] = 0 if top is None else top
        if top is not None:
            renames["logprobs"] = "top_logprobs"


def _openai_messages(messages: Any, fail: _Fail) -> list[dict[str, Any]]:
    if messages is None:
        raise fail(
            f'body.messages: missing; {CHAT_URL} needs messages like [{{"role": "user", '
            '"content": "..."}]'
        )
    if not isinstance(messages, list):
        raise fail(f"body.messages: expected a list of messages (got {show(messages)})")
    if not messages:
        raise fail("body.messages: empty; give at least one message")
    return [_openai_message(msg, f"body.messages[{i}]", fail) for i, msg in enumerate(messages)]


def _openai_message(msg: Any, where: str, fail: _Fail) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise fail(
            f'{where}: expected a message object like {{"role": "user", "content": "..."}} '
            f"(got {show(msg)})"
        )
    extra = [k for k, v in msg.items() if k not in ("role", "content") and v is not None]
    if extra:
        raise fail(
            f"{where}: unsupported {fields_named(extra)}; mlxq "
            "messages have only role and content (no tool calls or names)"
        )
    m: dict[str, Any] = {}
    if "role" in msg:
        m["role"] = msg["role"]
    content = msg.get("content")
    if isinstance(content, list):
        m["content"] = _join_parts(content, f"{where}.content", fail)
    elif content is not None:
        if not isinstance(content, str):
            raise fail(
                f"{where}.content: expected text or a list of text parts (got {show(content)})"
            )
        m["content"] = content
    return m


def _join_parts(parts: list[Any], where: str, fail: _Fail) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        at = f"{where}[{j}]"
        if isinstance(kind, str) and kind in _MEDIA_PARTS:
            raise fail(
                f"{at}: {show(kind)} content is not supported (mlxq serves text-only models); "
                "send text parts only"
            )
        if kind == "text":
            raise fail(f"{at}.text: expected a string (got {show(part.get('text', None))})")
        raise fail(
            f"{at}: unsupported content part {show(part)}; only "
            '{"type": "text", "text": "..."} parts are supported'
        )
    return "\n".join(texts)


def _openai_prompt(prompt: Any, fail: _Fail) -> Any:
    if prompt is None:
        raise fail(f"body.prompt: missing; {COMPLETIONS_URL} needs a prompt (text or token ids)")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > 1:
            raise fail(
                f"body.prompt: a list of {len(prompt)} prompts; mlxq takes one prompt per "
                "line: write one line per prompt, each with its own custom_id"
            )
        prompt = prompt[0]
    if isinstance(prompt, str | list) and len(prompt) == 0:
        raise fail("body.prompt: empty; give text or at least one token id")
    return prompt
