"""Checking a batch's input file before anything is enqueued, as OpenAI does.

Every line goes through mlxq's own parser (:func:`mlxq.formats.inputs.parse_lines`), so the API
accepts exactly what ``mlxq submit`` accepts, with the same messages. On top of that, an
OpenAI line's ``url`` must be the batch's ``endpoint``, and all lines must name the same
``model`` (it picks the queue). Any bad line fails the whole batch, with one
:class:`~mlxq.api.objects.BatchError` per line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from mlxq.api.objects import BatchError
from mlxq.formats.inputs import DEFAULT_MAX_LINE_BYTES, parse_lines
from mlxq.wire import Request

# How many per-line errors a failed batch lists before a final "... and N more".
MAX_LISTED_ERRORS = 1000


class _Envelope(msgspec.Struct):
    """The only field of a line this module reads itself: the OpenAI line's ``url``."""

    url: str | None = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)


@dataclass
class Validated:
    """The outcome of validation: the requests in file order, their model and the first
    line that names it (else the first request's), or the errors."""

    requests: list[Request] = field(default_factory=list)
    model: str | None = None
    model_line: int = 1
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
    errors = [BatchError("invalid_request", e.message, line=e.line) for e in parsed.errors]
    for n in parsed.lines:
        problem = _endpoint_problem(lines[n - 1], endpoint)
        if problem:
            errors.append(BatchError("mismatched_endpoint", problem, param="url", line=n))
    model, model_line, model_errors = _one_model(parsed.requests, parsed.lines)
    errors.extend(model_errors)
    if errors:
        errors.sort(key=lambda e: e.line or 0)
        return Validated(errors=_capped(errors))
    return Validated(requests=parsed.requests, model=model, model_line=model_line)


def split_lines(content: bytes) -> list[bytes]:
    """The file's lines, split on ``\\n`` only, as ``mlxq submit`` reads them."""
    lines = content.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return lines


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


def _one_model(
    requests: list[Request], lines: list[int]
) -> tuple[str | None, int, list[BatchError]]:
    """The model all lines name (in ``body.model`` or ``metadata.model``), the first line
    naming it (else the first line), and a ``mismatched_model`` error for each line that
    names another one."""
    model: str | None = None
    first = lines[0] if lines else 1
    errors = []
    for req, n in zip(requests, lines, strict=True):
        name = req.metadata.get("model")
        if not isinstance(name, str):
            continue
        if model is None:
            model, first = name, n
        elif name != model:
            errors.append(
                BatchError(
                    "mismatched_model",
                    f"body.model: {name!r} differs from {model!r} on line {first}; "
                    "all requests of a batch must use the same model",
                    param="body.model",
                    line=n,
                )
            )
    return model, first, errors


def _capped(errors: list[BatchError]) -> list[BatchError]:
    if len(errors) <= MAX_LISTED_ERRORS:
        return errors
    more = len(errors) - MAX_LISTED_ERRORS
    return [
        *errors[:MAX_LISTED_ERRORS],
        BatchError("too_many_errors", f"... and {more} more invalid lines"),
    ]
