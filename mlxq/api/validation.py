"""Checking a batch's input file before anything is enqueued, as OpenAI does.

Every line goes through mlxq's own parser (:func:`mlxq.formats.inputs.parse_lines`), so the API
accepts exactly what ``mlxq submit`` accepts, with the same messages. On top of that, an
OpenAI line's ``url`` must be the batch's ``endpoint``. Each line's ``model`` picks its
queue (lines may mix models). Any bad line fails the whole batch, with one
:class:`~mlxq.api.objects.BatchError` per line, whose ``param`` is the field its message
names (``body.tools``, ``url``...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import msgspec

from mlxq.api.objects import BatchError
from mlxq.formats.inputs import DEFAULT_MAX_LINE_BYTES, parse_lines
from mlxq.wire import Request

# How many per-line errors a failed batch lists before a final "... and N more".
MAX_LISTED_ERRORS = 1000
# A line error's message starts with the field it is about: "body.tools: ...".
_FIELD = re.compile(r"^((?:body|url|method|custom_id)(?:\.\w+|\[\d+\])*): ")


class _Envelope(msgspec.Struct):
    """The only field of a line this module reads itself: the OpenAI line's ``url``."""

    url: str | None = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)


@dataclass
class Validated:
    """The outcome of validation: the requests in file order, the first model they name
    (the batch's: lines naming none go to its queue), each model with the first line naming
    it (``None``: the lines naming none), or the errors."""

    requests: list[Request] = field(default_factory=list)
    model: str | None = None
    model_lines: dict[str | None, int] = field(default_factory=dict)
    errors: list[BatchError] = field(default_factory=list)


def validate_input(content: bytes, endpoint: str, *, max_lines: int) -> Validated:
    """Parse and check an input file for a batch on ``endpoint``."""
    lines = split_lines(content)
    count = sum(1 for line in lines if line.strip())
    if count == 0:
        return _fail("empty_file", "the input file has no requests")
    if count > max_lines:
        return _fail(
            "too_many_requests",
            f"the input file has {count} requests; a batch takes at most {max_lines}",
        )
    parsed = parse_lines(lines, max_line_bytes=DEFAULT_MAX_LINE_BYTES)
    errors = [
        BatchError("invalid_request", e.message, param=_param(e.message), line=e.line)
        for e in parsed.errors
    ]
    for n in parsed.lines:
        problem = _endpoint_problem(lines[n - 1], endpoint)
        if problem:
            errors.append(BatchError("mismatched_endpoint", problem, param="url", line=n))
    if errors:
        errors.sort(key=lambda e: e.line or 0)
        return Validated(errors=_capped(errors))
    model_lines = _models(parsed.requests, parsed.lines)
    model = next((m for m in model_lines if m is not None), None)
    return Validated(requests=parsed.requests, model=model, model_lines=model_lines)


def split_lines(content: bytes) -> list[bytes]:
    """The file's lines, split on ``\\n`` only, as ``mlxq submit`` reads them."""
    lines = content.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return lines


def _param(message: str) -> str | None:
    """The field a line error's message names first, if it names one."""
    m = _FIELD.match(message)
    return m[1] if m else None


def _fail(code: str, message: str) -> Validated:
    return Validated(errors=[BatchError(code, message)])


def _endpoint_problem(raw: bytes, endpoint: str) -> str | None:
    """Why an (otherwise valid) line does not belong in a batch on ``endpoint``, if it does
    not. mlxq's own request lines have no url and fit either endpoint."""
    try:
        url = _envelope_decoder.decode(raw.removeprefix(b"\xef\xbb\xbf")).url
    except msgspec.MsgspecError:  # an mlxq line with some other `url`: not an endpoint
        return None
    if url is None or url.rstrip("/") == endpoint:
        return None
    return (
        f"url: {url!r} does not match the batch's endpoint {endpoint!r}; every line of a "
        "batch must use the batch's endpoint"
    )


def _models(requests: list[Request], lines: list[int]) -> dict[str | None, int]:
    """Each model the lines name (in ``body.model``, ``model`` or, as before lines could
    name one, ``metadata.model``), with the first line naming it; ``None``: lines naming
    none. A model found in ``metadata`` becomes the request's, so it routes the line."""
    out: dict[str | None, int] = {}
    for req, n in zip(requests, lines, strict=True):
        named = req.metadata.get("model")
        if req.model is None and isinstance(named, str) and named:
            req.model = named
        out.setdefault(req.model, n)
    return out


def _capped(errors: list[BatchError]) -> list[BatchError]:
    if len(errors) <= MAX_LISTED_ERRORS:
        return errors
    more = len(errors) - MAX_LISTED_ERRORS
    return [
        *errors[:MAX_LISTED_ERRORS],
        BatchError("too_many_errors", f"... and {more} more invalid lines"),
    ]
