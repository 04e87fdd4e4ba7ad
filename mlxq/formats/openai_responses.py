"""OpenAI Responses API request bodies (``/v1/responses`` batch lines), mapped onto mlxq.

:func:`responses_fields` turns a line's checked body into the fields of a
:class:`~mlxq.wire.Request` (:mod:`mlxq.formats.openai_input` reads the envelope, the
model and the metadata, and converts): ``input`` (text, or a list of message items whose
content is text or ``input_text`` parts) and ``instructions`` (a system message first)
become ``messages``; ``max_output_tokens`` is ``max_tokens``; ``text.format``
(``json_schema``, ``json_object``, ``text``, and mlxq's ``regex`` and ``grammar``) is
``response_format``; ``temperature`` and ``top_p`` pass through, as do mlxq's ``seed``,
``top_k``, ``min_p`` and ``repetition_penalty``. ``developer`` messages are system
messages. ``user``, ``safety_identifier``, ``prompt_cache_key``, ``store`` and
``parallel_tool_calls`` change nothing here and are accepted; so are ``tools: []``,
``tool_choice`` ``none`` or ``auto`` (no tools), ``include`` of
``reasoning.encrypted_content`` (there is no reasoning to include), ``truncation:
"disabled"``, ``reasoning`` with no effort, and ``stream``/``background`` false. Anything
else mlxq cannot do (tools, images and files, earlier responses, reasoning, stored
prompts...) fails the line, naming the field. The output side is
:func:`mlxq.formats.openai_output.response_body`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxq.formats.input_errors import InvalidLine, fields_named, show

__all__ = [
    "BODY_FIELDS",
    "EMBEDDINGS_URL",
    "RESPONSES_URL",
    "refuse_unsupported",
    "response_format_problem",
    "responses_fields",
    "unknown_field_hint",
]

RESPONSES_URL = "/v1/responses"
EMBEDDINGS_URL = "/v1/embeddings"

BODY_FIELDS = (
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "store",
    "include",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "truncation",
    "reasoning",
    "stream",
    "background",
    # mlxq extras
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
)
# Body fields passed to Request unchanged (its constraints check them).
_PASSTHROUGH = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty")
# Fields of OpenAI's Responses API that mlxq cannot honour at all, and what to do instead.
_REFUSED = {
    "previous_response_id": "mlxq keeps no responses: send the whole conversation in `input`",
    "conversation": "mlxq keeps no conversations: send the whole conversation in `input`",
    "prompt": "stored prompt templates are not supported: send the text in `input`",
    "top_logprobs": f"logprobs are not supported on {RESPONSES_URL} yet: use "
    '/v1/chat/completions lines with "logprobs": true',
    "max_tool_calls": "tools are not supported (mlxq runs plain text generation)",
}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_ITEM_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio", "image_url", "file"})
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})  # nothing to include: no reasoning
_FORMAT_KEYS = {
    "text": ("type",),
    "json_object": ("type",),
    "json_schema": ("type", "name", "schema", "strict", "description"),
    "regex": ("type", "pattern"),
    "grammar": ("type", "lark"),
}
_Fail = Callable[[str], InvalidLine]


def refuse_unsupported(body: dict[str, Any], fail: _Fail) -> None:
    """Refuse what a ``/v1/responses`` body asks that mlxq cannot do, naming the field
    (``body`` has no null fields)."""
    for key, why in _REFUSED.items():
        if key in body:
            raise fail(f"body.{key}: not supported (got {show(body[key])}); {why}")
    tools = body.get("tools", [])
    if not isinstance(tools, list) or tools:
        raise fail(
            f"body.tools: tools are not supported (got {show(tools)}); mlxq runs plain text "
            "generation: remove tools, or give an empty list"
        )
    choice = body.get("tool_choice", "auto")
    if choice not in ("none", "auto"):
        raise fail(
            f'body.tool_choice: only "none" or "auto" (with no tools) is supported (got '
            f"{show(choice)}); remove it"
        )
    for key in ("background", "parallel_tool_calls", "store"):
        if key in body and not isinstance(body[key], bool):
            raise fail(f"body.{key}: expected true or false (got {show(body[key])})")
    if body.get("background", False):
        raise fail(
            "body.background: background responses are not supported (got true); a batch "
            "already runs in the background: remove it or set it to false"
        )
    _refuse_reasoning(body.get("reasoning"), fail)
    _check_include(body.get("include", []), fail)
    truncation = body.get("truncation", "disabled")
    if truncation != "disabled":
        raise fail(
            f'body.truncation: only "disabled" is supported (got {show(truncation)}); mlxq '
            "does not drop input to fit the model's context: shorten the input instead"
        )
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        if key in body and not isinstance(body[key], str):
            raise fail(f"body.{key}: expected a string (got {show(body[key])})")


def _refuse_reasoning(reasoning: Any, fail: _Fail) -> None:
    """``reasoning`` is accepted only when it asks for none (no effort, no summary)."""
    if reasoning is None:
        return
    if isinstance(reasoning, dict):
        asked = {k: v for k, v in reasoning.items() if v is not None}
        if not asked or asked == {"effort": "none"}:
            return
    raise fail(
        f"body.reasoning: not supported (got {show(reasoning)}); mlxq has no reasoning "
        "controls or summaries: remove it"
    )


def _check_include(include: Any, fail: _Fail) -> None:
    if not isinstance(include, list):
        raise fail(f"body.include: expected a list of strings (got {show(include)})")
    for i, name in enumerate(include):
        if not isinstance(name, str) or name not in _INCLUDABLE:
            raise fail(
                f"body.include[{i}]: {show(name)} is not supported; mlxq can include nothing "
                "beyond the output text: remove it"
            )


def unknown_field_hint(unknown: list[str]) -> str:
    """What a chat or completions field given to ``/v1/responses`` is called there."""
    renamed = {
        "messages": "input",
        "max_tokens": "max_output_tokens",
        "max_completion_tokens": "max_output_tokens",
        "response_format": "text.format",
    }
    hints = [f"`{k}` is `{renamed[k]}` on {RESPONSES_URL}" for k in unknown if k in renamed]
    return f" ({'; '.join(hints)})" if hints else ""


def responses_fields(body: dict[str, Any], d: dict[str, Any], fail: _Fail) -> dict[str, str]:
    """Set the Request fields of a checked ``/v1/responses`` body in ``d``; return the
    renames (Request field → the body's name) for error messages."""
    d["messages"] = _messages(body, fail)
    renames: dict[str, str] = {}
    if "max_output_tokens" in body:
        d["max_tokens"] = body["max_output_tokens"]
        renames["max_tokens"] = "max_output_tokens"
    for k in _PASSTHROUGH:
        if k in body:
            d[k] = body[k]
    if "text" in body:
        fmt = _text_format(body["text"], fail)
        if fmt is not None:
            d["response_format"] = fmt
            renames["response_format"] = "text.format"
    return renames


def response_format_problem(problem: str) -> str:
    """A ``response_format`` problem (``constraint_problem``) named as ``text.format``."""
    for old, new in (
        ("response_format.json_schema.schema", "text.format.schema"),
        ("response_format.", "text.format."),
    ):
        if problem.startswith(old):
            return "body." + new + problem[len(old) :]
    return "body." + problem


# -- input ----------------------------------------------------------------------------------


def _messages(body: dict[str, Any], fail: _Fail) -> list[dict[str, Any]]:
    """``instructions`` as a system message, then ``input``'s messages."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise fail(f"body.instructions: expected text (got {show(instructions)})")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if given is None:
        raise fail(
            f"body.input: missing; {RESPONSES_URL} needs input: text, or a list of messages "
            'like [{"role": "user", "content": "..."}]'
        )
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        if not given:
            raise fail("body.input: empty; give text or at least one message")
        messages += [_item(item, f"body.input[{i}]", fail) for i, item in enumerate(given)]
    else:
        raise fail(f"body.input: expected text or a list of messages (got {show(given)})")
    return messages


def _item(item: Any, where: str, fail: _Fail) -> dict[str, Any]:
    """One input item: a message (``type`` "message" or none) with a role and content."""
    if not isinstance(item, dict):
        raise fail(
            f'{where}: expected a message like {{"role": "user", "content": "..."}} '
            f"(got {show(item)})"
        )
    kind = item.get("type", "message")
    if kind != "message":
        raise fail(_item_type_problem(kind, where))
    extra = [k for k, v in item.items() if k not in _ITEM_KEYS and v is not None]
    if extra:
        raise fail(
            f"{where}: unsupported {fields_named(extra)}; mlxq input messages have only "
            "type, role and content"
        )
    role = item.get("role")
    if role is None:
        raise fail(f'{where}.role: missing; give "user", "assistant", "system" or "developer"')
    if not isinstance(role, str) or role not in _ROLES:
        raise fail(
            f'{where}.role: unsupported role {show(role)}; use "user", "assistant", "system" '
            'or "developer"'
        )
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = _join_parts(content, role == "assistant", f"{where}.content", fail)
    else:
        raise fail(
            f"{where}.content: expected text or a list of input_text parts (got {show(content)})"
        )
    return {"role": _ROLES[role], "content": text}


def _item_type_problem(kind: Any, where: str) -> str:
    at = f"{where}.type"
    if isinstance(kind, str) and (kind.endswith(("_call", "_call_output"))):
        return f"{at}: {show(kind)} items are not supported; mlxq runs no tools: send messages only"
    if kind == "reasoning":
        return f'{at}: "reasoning" items are not supported; mlxq has no reasoning: remove them'
    if kind == "item_reference":
        return (
            f'{at}: "item_reference" items are not supported; mlxq keeps no responses: '
            "send the item itself"
        )
    return f'{at}: unsupported input item type {show(kind)}; only "message" items are supported'


def _join_parts(parts: list[Any], assistant: bool, where: str, fail: _Fail) -> str:
    """A message's text parts joined with newlines: ``input_text`` (and, replaying an
    assistant's message, ``output_text``)."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}[{j}]"
        if kind == "input_text" or (kind == "output_text" and assistant):
            if not isinstance(part.get("text"), str):
                raise fail(f"{at}.text: expected a string (got {show(part.get('text', None))})")
            texts.append(part["text"])
        elif isinstance(kind, str) and kind in _MEDIA_PARTS:
            raise fail(
                f"{at}: {show(kind)} content is not supported (mlxq serves text-only models); "
                "send input_text parts only"
            )
        else:
            allowed = '"input_text" (or an assistant\'s "output_text")'
            raise fail(f"{at}: unsupported content part {show(part)}; only {allowed} parts")
    return "\n".join(texts)


# -- text.format ----------------------------------------------------------------------------


def _text_format(text: Any, fail: _Fail) -> dict[str, Any] | None:
    """``text.format`` as a ``response_format`` (None: free text); ``text.verbosity`` is
    accepted only at its default."""
    if not isinstance(text, dict):
        raise fail(
            'body.text: expected an object like {"format": {"type": "json_schema", "name": '
            f'"...", "schema": {{...}}}}}} (got {show(text)})'
        )
    extra = [k for k, v in text.items() if k not in ("format", "verbosity") and v is not None]
    if extra:
        raise fail(f"body.text: unsupported {fields_named(extra)}; text has format and verbosity")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise fail(
            f"body.text.verbosity: not supported (got {show(verbosity)}); mlxq cannot steer "
            "verbosity: remove it, or ask for brevity in the instructions"
        )
    fmt = text.get("format")
    if fmt is None:
        return None
    where = "body.text.format"
    if not isinstance(fmt, dict):
        raise fail(f'{where}: expected an object like {{"type": "json_schema"}} (got {show(fmt)})')
    kind = fmt.get("type")
    if not isinstance(kind, str) or kind not in _FORMAT_KEYS:
        raise fail(
            f'{where}.type: unsupported {show(kind)}; use "json_schema", "json_object" or '
            '"text" (or mlxq\'s "regex" and "grammar")'
        )
    keys = _FORMAT_KEYS[kind]
    extra = [k for k, v in fmt.items() if k not in keys and v is not None]
    if extra:
        raise fail(
            f"{where}: unsupported {fields_named(extra)} for type {kind!r}; it has "
            + ", ".join(keys)
        )
    if kind != "json_schema":
        return {k: v for k, v in fmt.items() if v is not None}
    return {"type": "json_schema", "json_schema": _json_schema(fmt, where, fail)}


def _json_schema(fmt: dict[str, Any], where: str, fail: _Fail) -> dict[str, Any]:
    """The Responses API's flat json_schema format as the nested ``json_schema`` object."""
    schema = fmt.get("schema")
    if schema is None:
        raise fail(f"{where}.schema: missing; give the JSON Schema the output must follow")
    if not isinstance(schema, dict):
        raise fail(f"{where}.schema: expected a JSON Schema object (got {show(schema)})")
    spec: dict[str, Any] = {"schema": schema}
    name = fmt.get("name")
    if name is not None:
        if not isinstance(name, str) or not 1 <= len(name) <= 64:
            raise fail(f"{where}.name: expected a name of 1 to 64 characters (got {show(name)})")
        spec["name"] = name
    strict = fmt.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise fail(f"{where}.strict: expected true or false (got {show(strict)})")
        spec["strict"] = strict
    description = fmt.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise fail(f"{where}.description: expected a string (got {show(description)})")
        spec["description"] = description
    return spec
