"""Reading ``mlxq submit`` input files: JSONL, one request per line, checked before enqueueing.

Each non-blank line is one of two forms, mixed freely:

* mlxq's own: exactly a :class:`~mlxq.wire.Request` (``prompt`` text or token ids, or chat
  ``messages``, plus sampling fields). A line without ``custom_id`` gets ``line-<N>``.
* An OpenAI Batch API line ``{"custom_id", "method": "POST", "url", "body"}`` for
  ``/v1/chat/completions`` or ``/v1/completions``, so existing batch files run unchanged
  (see :func:`mlxq.formats.openai_input.request_from_openai`).

Every bad line becomes a :class:`LineError` with its 1-based line number and a message
that names the field, says what is wrong and how to fix it. :func:`read_requests` reads a
file streaming and, unless told to skip invalid lines, raises :class:`InputFileError`
listing every bad line before anything could be enqueued.
"""

from __future__ import annotations

import sys
from codecs import BOM_UTF8
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from mlxq.engine.constraints.grammar import constraint_problem
from mlxq.formats.defaults import RequestDefaults, given_fields
from mlxq.formats.input_errors import (
    InvalidLine,
    LineError,
    decode_json,
    explain,
    fields_named,
    json_kind,
    show,
)
from mlxq.formats.openai_input import CHAT_URL, COMPLETIONS_URL, is_openai_line, request_from_openai
from mlxq.wire import Request, request_decoder

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

_REQUEST_FIELDS: tuple[str, ...] = Request.__struct_fields__


# --------------------------------------------------------------------------------------
# Public types


@dataclass
class ParsedInput:
    """The requests of an input, in file order, with the line each came from, and the errors."""

    requests: list[Request] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)


class InputFileError(ValueError):
    """An input file that cannot be submitted as it is.

    ``str()`` is a readable report: one ``FILE:LINE: message`` line per bad input line,
    capped at ``MAX_REPORTED_ERRORS`` lines with a final ``... and N more invalid lines``,
    followed by ``summary`` when there is one (e.g. ``no requests in FILE``).
    """

    def __init__(
        self,
        path: str,
        errors: list[LineError],
        summary: str | None = None,
        *,
        skippable: bool = False,
    ) -> None:
        self.path = path
        self.errors = list(errors)
        self.summary = summary
        # Whether skipping the bad lines leaves requests to submit (--skip-invalid helps).
        self.skippable = skippable
        super().__init__(self.report())

    def report(self, max_listed: int = MAX_REPORTED_ERRORS) -> str:
        out = [f"{self.place(e.line)}: {e.message}" for e in self.errors[:max_listed]]
        if len(self.errors) > max_listed:
            more = len(self.errors) - max_listed
            out.append(f"... and {more} more invalid line{'s' if more != 1 else ''}")
        if self.summary:
            out.append(self.summary)
        return "\n".join(out)

    def place(self, line: int) -> str:
        """Where an error is, as the report names it (``FILE:LINE``)."""
        return f"{self.path}:{line}"

    def __str__(self) -> str:
        return self.report()


# --------------------------------------------------------------------------------------
# Reading files


def read_requests(
    path: str | PathLike[str] | BinaryIO,
    *,
    skip_invalid: bool = False,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    defaults: RequestDefaults | None = None,
) -> ParsedInput:
    """Read and check every request of a JSONL file (``"-"`` reads stdin).

    The file is read line by line; a line longer than ``max_line_bytes`` (not counting its
    line ending) is reported without being decoded or held in memory. With
    ``skip_invalid=False`` any bad line raises :class:`InputFileError` listing all of
    them; with ``skip_invalid=True`` the valid requests are returned and the bad lines are
    in ``errors``. A file with no valid request at all always raises. ``path`` may also
    be an open binary file (or a text one, whose limit then counts characters).
    ``defaults`` fill in the fields a line leaves out (see :mod:`mlxq.formats.defaults`).
    """
    if isinstance(path, str) and path == "-":
        return _read_stream(sys.stdin.buffer, "<stdin>", skip_invalid, max_line_bytes, defaults)
    if isinstance(path, str | PathLike):
        name = str(path)
        with Path(path).open("rb") as f:
            return _read_stream(f, name, skip_invalid, max_line_bytes, defaults)
    name = getattr(path, "name", None)
    name = name if isinstance(name, str) else "<input>"
    return _read_stream(path, name, skip_invalid, max_line_bytes, defaults)


def _read_stream(
    f: Any, name: str, skip_invalid: bool, max_line_bytes: int, defaults: RequestDefaults | None
) -> ParsedInput:
    parsed = parse_lines(_iter_lines(f, max_line_bytes), defaults=defaults)
    return checked(parsed, name, skip_invalid)


def checked(
    parsed: ParsedInput,
    name: str,
    skip_invalid: bool,
    error: type[InputFileError] = InputFileError,
    what: str = "requests",
) -> ParsedInput:
    """``parsed``, or ``error`` if it has bad lines (unless skipped) or no requests at all."""
    if not parsed.requests:
        summary = f"no valid {what} in {name}" if parsed.errors else f"no {what} in {name}"
        raise error(name, parsed.errors, summary)
    if parsed.errors and not skip_invalid:
        raise error(name, parsed.errors, skippable=True)
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
    while chunk := f.readline(read):
        if _ends_line(chunk) or len(chunk) < read:
            size = _content_len(chunk)
        else:
            size = _skip_rest(f, chunk)
        yield _Oversized(size, max_line_bytes) if size > max_line_bytes else chunk


def _skip_rest(f: Any, chunk: bytes | str) -> int:
    """Read past the rest of a line that goes on after ``chunk``, without keeping it;
    return the line's length without its ending."""
    total, tail = len(chunk), chunk[-2:]
    while chunk := f.readline(1 << 16):
        total += len(chunk)
        tail = (tail + chunk)[-2:]
        if _ends_line(chunk):
            break
    return total - (len(tail) - _content_len(tail))


def parse_lines(
    lines: Iterable[bytes | str],
    *,
    max_line_bytes: int | None = None,
    defaults: RequestDefaults | None = None,
) -> ParsedInput:
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
            req, assigned = _parse_line(raw, n, defaults)
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
        return raw[3:] if raw.startswith(BOM_UTF8) else raw
    return raw[1:] if raw.startswith("\ufeff") else raw


def _duplicate_message(cid: str, assigned: bool, first: int, first_assigned: bool) -> str:
    shown = show(cid)
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


def _parse_line(
    raw: bytes | str, line: int, defaults: RequestDefaults | None = None
) -> tuple[Request, bool]:
    """The Request of a line, and whether its custom_id is the default one given here."""
    raw = _utf8(raw, line)
    if not raw or raw.isspace():
        raise InvalidLine(line, "blank line: give one JSON request object per line")
    # Fast path: a valid mlxq line decodes straight into a Request.
    failure: Exception | None = None
    try:
        req = request_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        failure = e
    if failure is not None:
        req = _request_from_json(raw, line, failure)
    if defaults:
        req = defaults.apply(req, given_fields(raw), line)
    if req.response_format is not None and (problem := constraint_problem(req.response_format)):
        raise InvalidLine(line, problem)  # (OpenAI lines were checked already: cached)
    if req.custom_id is None:
        req.custom_id = f"line-{line}"
        return req, True
    return req, False


def _utf8(raw: bytes | str, line: int) -> bytes:
    if not isinstance(raw, str):
        return raw
    try:
        return raw.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidLine(
            line,
            f"invalid text at character {e.start + 1}: a lone surrogate "
            f"(U+{ord(raw[e.start]):04X}) cannot be encoded as UTF-8",
        ) from e


def _request_from_json(raw: bytes, line: int, failure: Exception) -> Request:
    """The Request of a line that did not decode straight into one (``failure``).

    The line is decoded again as plain JSON to tell which form it is and explain what is
    wrong with it.
    """
    obj = decode_json(raw, line)
    if not isinstance(obj, dict):
        raise InvalidLine(
            line,
            f"expected a JSON object per line, got {json_kind(obj)}; "
            'write each request as {"prompt": ...} or {"messages": [...]}',
        ) from failure
    if is_openai_line(obj):
        return request_from_openai(obj, line)
    return _request_from_mlxq(obj, line, failure)


# --------------------------------------------------------------------------------------
# The mlxq form

_MLXQ_UNKNOWN_HINTS = {
    "max_completion_tokens": "use `max_tokens`",
    "top_logprobs": "use `logprobs` (the number of top alternatives per token)",
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
        raise InvalidLine(line, explain(e, obj)) from e


def _mlxq_shape_problem(obj: dict[str, Any]) -> str | None:
    """What is wrong with the fields given (rather than their values), if anything."""
    unknown = [k for k in obj if k not in _REQUEST_FIELDS]
    if unknown:
        hints = "; ".join(
            f"{k}: {_MLXQ_UNKNOWN_HINTS[k]}" for k in unknown if k in _MLXQ_UNKNOWN_HINTS
        )
        msg = f"unknown {fields_named(unknown)}"
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
