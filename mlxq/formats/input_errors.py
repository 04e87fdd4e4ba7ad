"""Bad input lines: the error types, and the wording shared by both line forms.

:class:`InvalidLine` is raised for a line that is not a valid request and :class:`LineError`
records one. The helpers render values and field names for messages, and :func:`explain`
turns a msgspec validation error into ``field: problem (got value); advice``.
"""

from __future__ import annotations

import re
from codecs import BOM_UTF8
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxq.wire import MAX_LOGPROBS, MAX_TOKENS_LIMIT

__all__ = [
    "InvalidLine",
    "LineError",
    "decode_json",
    "explain",
    "fields_named",
    "json_kind",
    "printable",
    "show",
]


@dataclass(frozen=True)
class LineError:
    """One bad input line: its 1-based number and what is wrong with it and how to fix it."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


class InvalidLine(ValueError):
    """A line that is not a valid request; ``error`` is its :class:`LineError`."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(line, message)
        self.line = line
        self.message = message

    @property
    def error(self) -> LineError:
        return LineError(self.line, self.message)

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


# --------------------------------------------------------------------------------------
# Showing values and names


def printable(s: str) -> str:
    """``s`` with control and other unprintable characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def json_kind(v: Any) -> str:
    """What kind of JSON value ``v`` is, e.g. ``a string``."""
    if isinstance(v, bool):
        return "a boolean"
    if v is None:
        return "null"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, list):
        return "an array"
    return "an object"


def show(v: Any, limit: int = 60) -> str:
    """A short JSON rendering of a value for error messages."""
    if isinstance(v, str | list) and len(v) > limit:
        v = v[:limit]
    try:
        s = msgspec.json.encode(v).decode()
    except Exception:  # not JSON-encodable or nested too deeply: name its kind only
        return json_kind(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def fields_named(keys: list[str]) -> str:
    """E.g. ``fields `a`, `b```: the first ten keys, printable and cut to 40 characters."""
    names = ", ".join(f"`{printable(k)[:40]}`" for k in keys[:10])
    return f"field{'s' if len(keys) > 1 else ''} {names}"


# --------------------------------------------------------------------------------------
# JSON syntax errors

_BYTE_AT = re.compile(r"^JSON is malformed: (?P<what>.*) \(byte (?P<pos>\d+)\)$")


def decode_json(raw: bytes, line: int) -> Any:
    """Decode a line as generic JSON, turning every failure into a readable InvalidLine."""
    try:
        return msgspec.json.decode(raw)
    except RecursionError as e:
        raise InvalidLine(line, "invalid JSON: nested too deeply") from e
    except msgspec.ValidationError as e:
        # Generic decoding fails only on numbers beyond what Python or a double can hold.
        detail = str(e).split(" - at ", 1)[0]
        raise InvalidLine(
            line,
            f"invalid JSON: {detail[:1].lower()}{detail[1:]}; numbers must fit a 64-bit "
            "float, and integers must have fewer than 4300 digits",
        ) from e
    except msgspec.DecodeError as e:
        raise InvalidLine(line, _json_error_message(raw, str(e))) from e


def _json_error_message(raw: bytes, detail: str) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        bad = raw[u.start : u.start + 1].hex().upper()
        msg = f"invalid UTF-8 at byte {u.start + 1} (0x{bad}): save the file as UTF-8"
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
            msg += " (it looks like UTF-16)"
        return msg
    if raw.startswith(BOM_UTF8):
        return (
            "invalid JSON: a UTF-8 byte-order mark (BOM) starts this line; "
            "one is allowed only at the start of the file"
        )
    m = _BYTE_AT.match(detail)
    if m is not None:
        return _malformed_message(raw, m["what"], int(m["pos"]))
    if detail == "Input data was truncated":
        return (
            "invalid JSON: the line ends before the JSON value is complete "
            '(a missing "}", "]" or closing quote?)'
        )
    return f"invalid JSON: {detail}"


def _malformed_message(raw: bytes, what: str, pos: int) -> str:
    """Explain msgspec's ``JSON is malformed: WHAT (byte POS)``, showing where."""
    if what == "trailing characters" and pos > 0:
        pos -= 1  # msgspec reports the offset just past the first extra character
    column = len(raw[:pos].decode("utf-8", "replace")) + 1
    text = raw.decode("utf-8", "replace").rstrip("\r\n")
    start = max(0, column - 1 - 20)
    near = printable(text[start : column - 1 + 20])
    near = ("..." if start else "") + near + ("..." if column - 1 + 20 < len(text) else "")
    msg = f"invalid JSON at column {column}: {what}, near `{near}`"
    if what == "trailing characters":
        msg += "; write exactly one JSON object per line"
    elif what == "object keys must be strings" or "'" in text[column - 1 : column]:
        msg += "; JSON needs double quotes around keys and strings"
    return msg


# --------------------------------------------------------------------------------------
# Validation errors

# Per-field advice, keyed by Request field; ``{name}`` is the field's name in the input.
_HINTS = {
    "prompt": "give {name} as non-empty text or a list of token ids (integers >= 0)",
    "messages": 'give {name} as a list of {{"role": "user", "content": "text"}} objects',
    "max_tokens": f"set {{name}} to an integer from 1 to {MAX_TOKENS_LIMIT}",
    "temperature": "set {name} to a number from 0 (greedy) to 10",
    "top_p": "set {name} to a number from 0 to 1 (1 = off)",
    "top_k": "set {name} to an integer >= 0 (0 = off)",
    "min_p": "set {name} to a number from 0 to 1 (0 = off)",
    "repetition_penalty": "set {name} to a number above 0 and at most 10 (1 = no penalty)",
    "seed": f"set {{name}} to an integer from 0 to {2**32 - 1}",
    "stop": "give {name} as a list of non-empty strings",
    "logprobs": f"set {{name}} to an integer from 0 to {MAX_LOGPROBS}: the number of top "
    "alternatives per token (0 = only the chosen token's logprob)",
    "custom_id": "give {name} as a non-empty string of at most 512 characters",
    "metadata": "give {name} as a JSON object",
    "response_format": "give {name} as "
    '{{"type": "json_schema", "json_schema": {{"name": "...", "schema": {{...}}}}}}, '
    '{{"type": "json_object"}}, {{"type": "regex", "pattern": "..."}} or '
    '{{"type": "grammar", "lark": "..."}}',
}
_MESSAGE_HINT = 'each message is {"role": "user", "content": "text"}'

_DETAIL_AT = re.compile(r"^(?P<detail>.*?) - at `\$(?P<path>[^`]*)`$", re.S)
_PATH_TOKEN = re.compile(r"\.(\w+)|\[(\d+)\]|\[\.\.\.\]")
_UNKNOWN = "Object contains unknown field "
_REQUIRED = "Object missing required field "
_MISSING = object()


def explain(
    e: msgspec.ValidationError,
    obj: dict[str, Any],
    *,
    renames: dict[str, str] | None = None,
    prefix: str = "",
) -> str:
    """Rewrite a msgspec validation error as ``field: problem (got value); advice``.

    ``obj`` is what was converted (for showing the bad value); ``renames`` maps Request
    fields to the names the input used, and ``prefix`` is put before them (except for
    ``custom_id``), e.g. ``body.`` for OpenAI lines.
    """
    text = str(e)
    m = _DETAIL_AT.match(text)
    if m is None:  # __post_init__ messages name their field already
        return text
    detail = m["detail"]
    tokens = _path_tokens(m["path"])
    if not tokens or not isinstance(tokens[0], str):
        return detail
    top = tokens[0]
    name = (renames or {}).get(top, top)
    shown_name = name if top == "custom_id" else prefix + name
    where = shown_name + "".join(f".{t}" if isinstance(t, str) else f"[{t}]" for t in tokens[1:])
    in_message = top == "messages" and len(tokens) > 1
    hint = _MESSAGE_HINT if in_message else _HINTS.get(top, "").format(name=name)
    if detail.startswith(_UNKNOWN):
        field_name = detail.removeprefix(_UNKNOWN)
        if in_message:
            return f"{where}: unknown field {field_name}; a message has only `role` and `content`"
        return f"{where}: unknown field {field_name}; {hint}"
    if detail.startswith(_REQUIRED):
        return f"{where}: missing {detail.removeprefix(_REQUIRED)}; {hint}"
    value = _lookup(obj, tokens)
    got = "" if value is _MISSING else f" (got {show(value)})"
    return f"{where}: {detail}{got}" + (f"; {hint}" if hint else "")


def _path_tokens(path: str) -> list[str | int]:
    """The keys and indexes of a msgspec error path like ``.messages[0].role``."""
    tokens: list[str | int] = []
    for t in _PATH_TOKEN.finditer(path):
        if t[1] is not None:
            tokens.append(t[1])
        elif t[2] is not None:
            tokens.append(int(t[2]))
        else:
            break  # "[...]": a dict key msgspec does not name
    return tokens


def _lookup(obj: Any, tokens: list[str | int]) -> Any:
    """The value at ``tokens`` in ``obj``, or ``_MISSING``."""
    value = obj
    for t in tokens:
        try:
            value = value[t]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return value
