"""Reading ``mlxq submit`` input files: JSONL, one request per line, checked before enqueueing.

Each non-blank line is one of two forms, mixed freely:

* mlxq's own: exactly a :class:`~mlxq.types.Request` (``prompt`` text or token ids, or chat
  ``messages``, plus sampling fields). A line without ``custom_id`` gets ``line-<N>``.
* An OpenAI Batch API line ``{"custom_id", "method": "POST", "url", "body"}`` for
  ``/v1/chat/completions`` or ``/v1/completions``, so existing batch files run unchanged
  (see :func:`request_from_openai`).

Every bad line becomes a :class:`LineError` with its 1-based line number and a message
that names the field, says what is wrong and how to fix it. :func:`read_requests` reads a
file streaming and, unless told to skip invalid lines, raises :class:`InputFileError`
listing every bad line before anything could be enqueued.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from mlxq.types import MAX_LOGPROBS, MAX_TOKENS_LIMIT, Request, request_decoder

__all__ = [
    "CHAT_URL",
    "COMPLETIONS_URL",
    "DEFAULT_MAX_LINE_BYTES",
    "InputFileError",
    "InvalidLine",
    "LineError",
    "ParsedInput",
    "parse_line",
    "parse_lines",
    "read_requests",
    "request_from_openai",
]

DEFAULT_MAX_LINE_BYTES = 1 << 20
# How many bad lines an InputFileError report lists before "... and N more".
MAX_REPORTED_ERRORS = 50

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

_BOM = b"\xef\xbb\xbf"
_REQUEST_FIELDS: tuple[str, ...] = Request.__struct_fields__
# Keys that mark a line as an OpenAI Batch API line rather than an mlxq Request.
_OPENAI_KEYS = frozenset({"method", "url", "body"})
_OPENAI_ENVELOPE = ("custom_id", "method", "url", "body")


# --------------------------------------------------------------------------------------
# Public types


@dataclass(frozen=True)
class LineError:
    """One bad input line: its 1-based number and what is wrong with it and how to fix it."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass
class ParsedInput:
    """The requests of an input, in file order, with the line each came from, and the errors."""

    requests: list[Request] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)


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


class InputFileError(ValueError):
    """An input file that cannot be submitted as it is.

    ``str()`` is a readable report: one ``FILE:LINE: message`` line per bad input line,
    capped at ``MAX_REPORTED_ERRORS`` lines with a final ``... and N more invalid lines``,
    followed by ``summary`` when there is one (e.g. ``no requests in FILE``).
    """

    def __init__(self, path: str, errors: list[LineError], summary: str | None = None) -> None:
        self.path = path
        self.errors = list(errors)
        self.summary = summary
        super().__init__(self.report())

    def report(self, max_listed: int = MAX_REPORTED_ERRORS) -> str:
        out = [f"{self.path}:{e.line}: {e.message}" for e in self.errors[:max_listed]]
        if len(self.errors) > max_listed:
            more = len(self.errors) - max_listed
            out.append(f"... and {more} more invalid line{'s' if more != 1 else ''}")
        if self.summary:
            out.append(self.summary)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.report()


# --------------------------------------------------------------------------------------
# Reading files


def read_requests(
    path: str | PathLike[str] | BinaryIO,
    *,
    skip_invalid: bool = False,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> ParsedInput:
    """Read and check every request of a JSONL file (``"-"`` reads stdin).

    The file is read line by line; a line longer than ``max_line_bytes`` (not counting its
    line ending) is reported without being decoded or held in memory. With
    ``skip_invalid=False`` any bad line raises :class:`InputFileError` listing all of
    them; with ``skip_invalid=True`` the valid requests are returned and the bad lines are
    in ``errors``. A file with no valid request at all always raises. ``path`` may also
    be an open binary file (or a text one, whose limit then counts characters).
    """
    if isinstance(path, str) and path == "-":
        return _read_stream(sys.stdin.buffer, "<stdin>", skip_invalid, max_line_bytes)
    if isinstance(path, str | PathLike):
        name = str(path)
        with Path(path).open("rb") as f:
            return _read_stream(f, name, skip_invalid, max_line_bytes)
    name = getattr(path, "name", None)
    return _read_stream(
        path, name if isinstance(name, str) else "<input>", skip_invalid, max_line_bytes
    )


def _read_stream(f: Any, name: str, skip_invalid: bool, max_line_bytes: int) -> ParsedInput:
    parsed = parse_lines(_iter_lines(f, max_line_bytes))
    if parsed.errors and not skip_invalid:
        raise InputFileError(name, parsed.errors)
    if not parsed.requests:
        summary = f"no valid requests in {name}" if parsed.errors else f"no requests in {name}"
        raise InputFileError(name, parsed.errors, summary)
    return parsed


class _Oversized:
    """Stands in for a line over the size limit, which is skipped without being kept."""

    __slots__ = ("limit", "size")

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit

    def message(self) -> str:
        return (
            f"line is too long: {self.size} bytes, over the limit of {self.limit} bytes "
            "(max_line_bytes); shorten the prompt or raise the limit"
        )


def _ends_line(chunk: bytes | str) -> bool:
    return chunk[-1:] in (b"\n", "\n")


def _content_len(chunk: bytes | str) -> int:
    """Length of a line without its ``\\n`` or ``\\r\\n`` ending."""
    if not _ends_line(chunk):
        return len(chunk)
    return len(chunk) - (2 if chunk[-2:] in (b"\r\n", "\r\n") else 1)


def _iter_lines(f: Any, max_line_bytes: int) -> Iterator[bytes | str | _Oversized]:
    """The lines of ``f``; a line over ``max_line_bytes`` is read past in bounded chunks."""
    if max_line_bytes < 1:
        raise ValueError("max_line_bytes must be positive")
    # +2 so that a line of exactly the limit still arrives whole with its "\r\n".
    read = max_line_bytes + 2
    while True:
        chunk = f.readline(read)
        if not chunk:
            return
        if _ends_line(chunk) or len(chunk) < read:
            size = _content_len(chunk)
        else:
            # The line goes on: count the rest of it without keeping it.
            total, tail = len(chunk), chunk[-2:]
            while True:
                chunk = f.readline(1 << 16)
                if not chunk:
                    break
                total += len(chunk)
                tail = (tail + chunk)[-2:]
                if _ends_line(chunk):
                    break
            size = total - (len(tail) - _content_len(tail))
        if size > max_line_bytes:
            yield _Oversized(size, max_line_bytes)
        else:
            yield chunk


def parse_lines(lines: Iterable[bytes | str], *, max_line_bytes: int | None = None) -> ParsedInput:
    """Parse lines (1-based numbering) into requests, collecting errors instead of raising.

    Blank lines are skipped; a UTF-8 byte-order mark on the first line is dropped. A
    ``custom_id`` used by an earlier line makes the later line an error that names the
    first. With ``max_line_bytes``, longer lines are errors and are not decoded.
    """
    out = ParsedInput()
    seen: dict[str, tuple[int, bool]] = {}  # custom_id -> (line, was it assigned by us)
    for n, raw in enumerate(lines, 1):
        if isinstance(raw, _Oversized):
            out.errors.append(LineError(n, raw.message()))
            continue
        if n == 1:
            raw = _strip_bom(raw)
        if not raw or raw.isspace():
            continue
        if max_line_bytes is not None and _content_len(raw) > max_line_bytes:
            out.errors.append(LineError(n, _Oversized(_content_len(raw), max_line_bytes).message()))
            continue
        try:
            req, assigned = _parse_line(raw, n)
        except InvalidLine as e:
            out.errors.append(e.error)
            continue
        cid: str = req.custom_id  # type: ignore[assignment]
        first = seen.get(cid)
        if first is not None:
            out.errors.append(LineError(n, _duplicate_message(cid, assigned, *first)))
            continue
        seen[cid] = (n, assigned)
        out.requests.append(req)
        out.lines.append(n)
    return out


def _strip_bom(raw: bytes | str) -> bytes | str:
    if isinstance(raw, bytes):
        return raw[3:] if raw.startswith(_BOM) else raw
    return raw[1:] if raw.startswith("\ufeff") else raw


def _duplicate_message(cid: str, assigned: bool, first: int, first_assigned: bool) -> str:
    shown = _show(cid)
    if assigned:
        what = f"this line has no custom_id and its default {shown}"
    else:
        what = f"custom_id {shown}"
    by = f"line {first}" + (" (its default id, as it has no custom_id)" if first_assigned else "")
    return f"custom_id: {what} is already used by {by}; give every request a unique custom_id"


# --------------------------------------------------------------------------------------
# One line


def parse_line(raw: bytes | str, line: int) -> Request:
    """Parse one input line (either form) into a Request; raise :class:`InvalidLine` if bad.

    A line without ``custom_id`` (mlxq form only) gets ``line-<line>``.
    """
    return _parse_line(raw, line)[0]


def _parse_line(raw: bytes | str, line: int) -> tuple[Request, bool]:
    if isinstance(raw, str):
        try:
            raw = raw.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidLine(
                line,
                f"invalid text at character {e.start + 1}: a lone surrogate "
                f"(U+{ord(raw[e.start]):04X}) cannot be encoded as UTF-8",
            ) from e
    if not raw or raw.isspace():
        raise InvalidLine(line, "blank line: give one JSON request object per line")
    # Fast path: a valid mlxq line decodes straight into a Request.
    failure: Exception | None = None
    try:
        req = request_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        failure = e
    if failure is not None:
        # Decode again as plain JSON to tell which form it is and explain what is wrong.
        obj = _decode_json(raw, line)
        if not isinstance(obj, dict):
            raise InvalidLine(
                line,
                f"expected a JSON object per line, got {_json_kind(obj)}; "
                'write each request as {"prompt": ...} or {"messages": [...]}',
            ) from failure
        if _OPENAI_KEYS.intersection(obj):
            return request_from_openai(obj, line), False
        req = _request_from_mlxq(obj, line, failure)
    if req.custom_id is None:
        req.custom_id = f"line-{line}"
        return req, True
    return req, False


def _decode_json(raw: bytes, line: int) -> Any:
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


_BYTE_AT = re.compile(r"^JSON is malformed: (?P<what>.*) \(byte (?P<pos>\d+)\)$")


def _json_error_message(raw: bytes, detail: str) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        bad = raw[u.start : u.start + 1].hex().upper()
        msg = f"invalid UTF-8 at byte {u.start + 1} (0x{bad}): save the file as UTF-8"
        if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
            msg += " (it looks like UTF-16)"
        return msg
    if raw.startswith(_BOM):
        return (
            "invalid JSON: a UTF-8 byte-order mark (BOM) starts this line; "
            "one is allowed only at the start of the file"
        )
    m = _BYTE_AT.match(detail)
    if m is None:
        if detail == "Input data was truncated":
            return (
                "invalid JSON: the line ends before the JSON value is complete "
                '(a missing "}", "]" or closing quote?)'
            )
        return f"invalid JSON: {detail}"
    what, pos = m["what"], int(m["pos"])
    if what == "trailing characters" and pos > 0:
        pos -= 1  # msgspec reports the offset just past the first extra character
    column = len(raw[:pos].decode("utf-8", "replace")) + 1
    text = raw.decode("utf-8", "replace").rstrip("\r\n")
    start = max(0, column - 1 - 20)
    near = _printable(text[start : column - 1 + 20])
    near = ("..." if start else "") + near + ("..." if column - 1 + 20 < len(text) else "")
    msg = f"invalid JSON at column {column}: {what}, near `{near}`"
    if what == "trailing characters":
        msg += "; write exactly one JSON object per line"
    elif what == "object keys must be strings" or "'" in text[column - 1 : column]:
        msg += "; JSON needs double quotes around keys and strings"
    return msg


def _printable(s: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def _json_kind(v: Any) -> str:
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


def _show(v: Any, limit: int = 60) -> str:
    """A short JSON rendering of a value for error messages."""
    if isinstance(v, str) and len(v) > limit:
        v = v[:limit]
    elif isinstance(v, list) and len(v) > limit:
        v = v[:limit]
    try:
        s = msgspec.json.encode(v).decode()
    except Exception:  # not JSON-encodable or nested too deeply: name its kind only
        return _json_kind(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


# --------------------------------------------------------------------------------------
# The mlxq form

_MLXQ_UNKNOWN_HINTS = {
    "model": "the queue's workers choose the model; to record one, put it in `metadata`",
    "max_completion_tokens": "use `max_tokens`",
    "top_logprobs": "use `logprobs` (the number of top alternatives per token)",
    "n": "write one line per completion",
    "stream": "streaming is not supported",
    "frequency_penalty": "not supported; use `repetition_penalty`",
    "presence_penalty": "not supported; use `repetition_penalty`",
    "id": "use `custom_id`",
}


def _request_from_mlxq(obj: dict[str, Any], line: int, cause: Exception) -> Request:
    """The Request of an mlxq-form line that failed to decode directly (``cause``)."""
    problem = _mlxq_shape_problem(obj)
    if problem:
        raise InvalidLine(line, problem) from cause
    try:
        return msgspec.convert(obj, Request)
    except msgspec.ValidationError as e:
        raise InvalidLine(line, _explain(e, obj)) from e


def _mlxq_shape_problem(obj: dict[str, Any]) -> str | None:
    """What is wrong with the fields given (rather than their values), if anything."""
    unknown = [k for k in obj if k not in _REQUEST_FIELDS]
    if unknown:
        names = ", ".join(f"`{_printable(k)[:40]}`" for k in unknown[:10])
        hints = "; ".join(
            f"{k}: {_MLXQ_UNKNOWN_HINTS[k]}" for k in unknown if k in _MLXQ_UNKNOWN_HINTS
        )
        msg = f"unknown field{'s' if len(unknown) > 1 else ''} {names}"
        if hints:
            msg += f" ({hints})"
        return (
            f"{msg}; supported fields: {', '.join(_REQUEST_FIELDS)} (or an OpenAI batch line "
            "with custom_id, method, url and body)"
        )
    has_prompt = obj.get("prompt") is not None
    has_messages = obj.get("messages") is not None
    if has_prompt and has_messages:
        return "both `prompt` and `messages` given: give exactly one of them"
    if not has_prompt and not has_messages:
        return (
            "missing `prompt` or `messages`: give the prompt as text or token ids, "
            'or chat `messages` like [{"role": "user", "content": "..."}]'
        )
    if obj.get("prompt") in ("", []):
        return "prompt: empty; give text or at least one token id"
    if obj.get("messages") == []:
        return "messages: empty; give at least one message"
    return None


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
}

_DETAIL_AT = re.compile(r"^(?P<detail>.*?) - at `\$(?P<path>[^`]*)`$", re.S)
_PATH_TOKEN = re.compile(r"\.(\w+)|\[(\d+)\]|\[\.\.\.\]")
_MISSING = object()


def _explain(
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
    tokens: list[str | int] = []
    for t in _PATH_TOKEN.finditer(m["path"]):
        if t[1] is not None:
            tokens.append(t[1])
        elif t[2] is not None:
            tokens.append(int(t[2]))
        else:
            break  # "[...]": a dict key msgspec does not name
    if not tokens or not isinstance(tokens[0], str):
        return detail
    top = tokens[0]
    name = (renames or {}).get(top, top)
    shown_name = name if top == "custom_id" else prefix + name
    where = shown_name + "".join(f".{t}" if isinstance(t, str) else f"[{t}]" for t in tokens[1:])

    value: Any = obj
    for t in tokens:
        try:
            value = value[t]
        except (KeyError, IndexError, TypeError):
            value = _MISSING
            break

    in_message = top == "messages" and len(tokens) > 1
    if in_message:
        hint = 'each message is {"role": "user", "content": "text"}'
    else:
        hint = _HINTS.get(top, "").format(name=name)
    if detail.startswith("Object contains unknown field "):
        field_name = detail.removeprefix("Object contains unknown field ")
        if in_message:
            return f"{where}: unknown field {field_name}; a message has only `role` and `content`"
        return f"{where}: unknown field {field_name}; {hint}"
    if detail.startswith("Object missing required field "):
        field_name = detail.removeprefix("Object missing required field ")
        return f"{where}: missing {field_name}; {hint}"
    got = "" if value is _MISSING else f" (got {_show(value)})"
    return f"{where}: {detail}{got}" + (f"; {hint}" if hint else "")


# --------------------------------------------------------------------------------------
# The OpenAI Batch API form

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
    # mlxq extras
    "top_k",
    "min_p",
    "repetition_penalty",
)
_BODY_FIELDS = {
    CHAT_URL: ("messages", "max_completion_tokens", "logprobs", "top_logprobs", *_COMMON_BODY),
    COMPLETIONS_URL: ("prompt", "logprobs", "echo", "best_of", *_COMMON_BODY),
}
# Body fields passed to Request unchanged (its constraints check them).
_PASSTHROUGH = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty")
_Fail = Callable[[str], InvalidLine]
_MEDIA_PARTS = frozenset(
    {"image_url", "input_image", "image", "input_audio", "audio", "file", "video", "video_url"}
)


def request_from_openai(obj: dict[str, Any], line: int) -> Request:
    """Map one OpenAI Batch API line (``custom_id``, ``method``, ``url``, ``body``) to a Request.

    ``url`` is ``/v1/chat/completions`` or ``/v1/completions``. In ``body``, a null value
    is the same as leaving the field out; ``model`` goes to ``metadata["model"]``;
    ``user`` is ignored; mlxq's ``top_k``, ``min_p`` and ``repetition_penalty`` are
    accepted; anything mlxq cannot honour (``n`` > 1, ``stream``, non-zero frequency or
    presence penalties, images, several prompts, tools...) is an error, as is any unknown
    field. Chat content given as a list of text parts is joined with newlines.
    """

    def fail(msg: str) -> InvalidLine:
        return InvalidLine(line, msg)

    unknown = [k for k in obj if k not in _OPENAI_ENVELOPE]
    if unknown:
        raise fail(
            f"unknown field{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(f'`{_printable(k)[:40]}`' for k in unknown[:10])} in an OpenAI batch "
            "line: it has only custom_id, method, url and body (request parameters go in body)"
        )
    if obj.get("custom_id") is None:
        raise fail("custom_id: missing; OpenAI batch lines need a unique custom_id string")
    method = obj.get("method")
    if method is None:
        raise fail('method: missing; OpenAI batch lines need "method": "POST"')
    if not isinstance(method, str) or method.upper() != "POST":
        raise fail(f'method: only "POST" is supported (got {_show(method)})')
    url = obj.get("url")
    endpoints = f'"{CHAT_URL}" and "{COMPLETIONS_URL}"'
    if url is None:
        raise fail(f"url: missing; mlxq supports {endpoints}")
    if not isinstance(url, str) or url.rstrip("/") not in _BODY_FIELDS:
        raise fail(f"url: unsupported endpoint {_show(url)}; mlxq supports {endpoints}")
    url = url.rstrip("/")
    body = obj.get("body")
    if body is None:
        raise fail(f"body: missing; put the {url} request parameters in body")
    if not isinstance(body, dict):
        raise fail(f"body: expected a JSON object (got {_show(body)})")
    chat = url == CHAT_URL

    # Null is "not given", as in OpenAI's API.
    body = {k: v for k, v in body.items() if v is not None}
    supported = _BODY_FIELDS[url]
    unknown = [k for k in body if k not in supported]
    if unknown:
        names = ", ".join(f"`{_printable(k)[:40]}`" for k in unknown[:10])
        msg = f"body: unsupported field{'s' if len(unknown) > 1 else ''} {names} for {url}"
        if chat and "prompt" in unknown:
            msg += f" (chat requests take `messages`; `prompt` is for {COMPLETIONS_URL})"
        elif not chat and "messages" in unknown:
            msg += f" (`messages` is for {CHAT_URL})"
        raise fail(f"{msg}; supported: {', '.join(supported)}")

    d: dict[str, Any] = {"custom_id": obj["custom_id"]}
    renames: dict[str, str] = {}

    # Things mlxq cannot do: refuse rather than silently do something else.
    for k in ("frequency_penalty", "presence_penalty"):
        v = body.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int | float) or v != 0:
            raise fail(
                f"body.{k}: not supported (got {_show(v)}); remove it or set it to 0, "
                "and use repetition_penalty (e.g. 1.1) to discourage repetition"
            )
    n = body.get("n", 1)
    if type(n) is not int or n != 1:
        raise fail(
            f"body.n: only n=1 is supported (got {_show(n)}); write one line per completion, "
            "each with its own custom_id (and seed, to get different samples)"
        )
    if body.get("stream", False) is not False:
        raise fail(
            f"body.stream: streaming is not supported in batches (got {_show(body['stream'])});"
            " remove it or set it to false"
        )
    if body.get("echo", False) is not False:
        raise fail(f"body.echo: not supported (got {_show(body['echo'])}); remove it")
    best_of = body.get("best_of", 1)
    if type(best_of) is not int or best_of != 1:
        raise fail(f"body.best_of: only 1 is supported (got {_show(best_of)}); remove it")

    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict):
        raise fail(f"body.metadata: expected a JSON object (got {_show(metadata)})")
    metadata = dict(metadata)
    if "model" in body:
        if not isinstance(body["model"], str):
            raise fail(f"body.model: expected a string (got {_show(body['model'])})")
        metadata["model"] = body["model"]
    if metadata:
        d["metadata"] = metadata

    if chat:
        d["messages"] = _openai_messages(body.get("messages"), fail)
    else:
        d["prompt"] = _openai_prompt(body.get("prompt"), fail)

    mt = body.get("max_tokens")
    mct = body.get("max_completion_tokens") if chat else None
    if mt is not None and mct is not None and mt != mct:
        raise fail(
            "body: max_tokens and max_completion_tokens differ "
            f"({_show(mt)} and {_show(mct)}); give only one"
        )
    if mct is not None:
        d["max_tokens"] = mct
        renames["max_tokens"] = "max_completion_tokens"
    elif mt is not None:
        d["max_tokens"] = mt

    for k in _PASSTHROUGH:
        if k in body:
            d[k] = body[k]
    if "stop" in body:
        stop = body["stop"]
        d["stop"] = [stop] if isinstance(stop, str) else stop

    if chat:
        logprobs = body.get("logprobs", False)
        top = body.get("top_logprobs")
        if not isinstance(logprobs, bool):
            raise fail(
                f"body.logprobs: expected true or false for {CHAT_URL} (got {_show(logprobs)}); "
                'set "logprobs": true and "top_logprobs" to the number of alternatives'
            )
        if top is not None and not logprobs:
            raise fail('body.top_logprobs: needs "logprobs": true; set it, or drop top_logprobs')
        if logprobs:
            d["logprobs"] = 0 if top is None else top
            if top is not None:
                renames["logprobs"] = "top_logprobs"
    elif "logprobs" in body:
        d["logprobs"] = body["logprobs"]

    try:
        return msgspec.convert(d, Request)
    except msgspec.ValidationError as e:
        raise fail(_explain(e, d, renames=renames, prefix="body.")) from e


def _openai_messages(messages: Any, fail: _Fail) -> list[dict[str, Any]]:
    if messages is None:
        raise fail(
            f'body.messages: missing; {CHAT_URL} needs messages like [{{"role": "user", '
            '"content": "..."}]'
        )
    if not isinstance(messages, list):
        raise fail(f"body.messages: expected a list of messages (got {_show(messages)})")
    if not messages:
        raise fail("body.messages: empty; give at least one message")
    out = []
    for i, msg in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(msg, dict):
            raise fail(
                f'{where}: expected a message object like {{"role": "user", "content": "..."}} '
                f"(got {_show(msg)})"
            )
        extra = [k for k, v in msg.items() if k not in ("role", "content") and v is not None]
        if extra:
            names = ", ".join(f"`{_printable(k)[:40]}`" for k in extra[:10])
            raise fail(
                f"{where}: unsupported field{'s' if len(extra) > 1 else ''} {names}; mlxq "
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
                    f"{where}.content: expected text or a list of text parts (got {_show(content)})"
                )
            m["content"] = content
        out.append(m)
    return out


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
                f"{at}: {_show(kind)} content is not supported (mlxq serves text-only models); "
                "send text parts only"
            )
        if kind == "text":
            raise fail(f"{at}.text: expected a string (got {_show(part.get('text', None))})")
        raise fail(
            f"{at}: unsupported content part {_show(part)}; only "
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
