"""Request defaults given on the command line (``--max-tokens 64 --system "..."``).

They apply to every request of an input that does not set the field itself: a line that
says ``"temperature": 0`` keeps 0 whatever ``--temperature`` says. For OpenAI Batch lines
the body's fields count (``max_completion_tokens`` sets ``max_tokens``, ``top_logprobs``
sets ``logprobs``; a null value is the same as leaving the field out, as OpenAI reads it).
``--system`` adds a system message to chat requests that have none; a ``prompt`` request
cannot take one and is an error for that line, never silently left without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from mlxq.engine.constraints.grammar import constraint_problem
from mlxq.formats.input_errors import InvalidLine, explain
from mlxq.wire import Message, Request, ResponseFormat

# Fields a default may set (the ones that shape generation, not identity or routing).
DEFAULTABLE = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "logprobs",
    "response_format",
    "n",
)
# OpenAI body names that set a Request field.
_OPENAI_NAMES = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}


@dataclass(frozen=True)
class RequestDefaults:
    """Field values for requests that leave them out, and a system message for chats."""

    fields: dict[str, Any] = field(default_factory=dict)
    system: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.fields) - set(DEFAULTABLE)
        if unknown:
            raise ValueError(f"cannot default {', '.join(sorted(unknown))}")
        try:  # check the values once, with the same constraints a line is held to
            req = msgspec.convert({"prompt": "x", **self.fields}, Request)
        except msgspec.ValidationError as e:
            raise ValueError(explain(e, self.fields)) from e
        if req.response_format is not None and (problem := constraint_problem(req.response_format)):
            raise ValueError(problem)

    def __bool__(self) -> bool:
        return bool(self.fields) or self.system is not None

    def apply(self, req: Request, given: set[str], line: int) -> Request:
        """``req`` with every default whose field is not in ``given`` (what the line set)."""
        changes = {k: v for k, v in self.fields.items() if k not in given}
        if "response_format" in changes:  # (a JSON object here; the field is a Struct)
            changes["response_format"] = msgspec.convert(changes["response_format"], ResponseFormat)
        if self.system is not None:
            if req.messages is None:
                raise InvalidLine(
                    line,
                    "--system applies to chat requests (`messages`), and this line has "
                    "`prompt`; write it as messages or drop --system",
                )
            if not any(m.role == "system" for m in req.messages):
                changes["messages"] = [Message("system", self.system), *req.messages]
        return msgspec.structs.replace(req, **changes) if changes else req


def given_fields(raw: bytes) -> set[str]:
    """The Request fields a JSON input line sets (top level, or an OpenAI line's body)."""
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return set()
    if not isinstance(obj, dict):
        return set()
    body = obj.get("body")
    if isinstance(body, dict) and ("url" in obj or "method" in obj):
        return {_OPENAI_NAMES.get(k, k) for k, v in body.items() if v is not None}
    return set(obj)
