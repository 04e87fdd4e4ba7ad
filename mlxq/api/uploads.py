"""``POST /v1/files``: a multipart upload, held to a size and a line-count limit.

The size limit is enforced while the body streams in (the ``Content-Length`` is checked
first, and the bytes received are counted, so a chunked upload cannot slip past it): an
over-size upload gets a 413 without being read to the end. Batch input files are also
limited in how many requests they may hold (400). Content is checked line by line only
when a batch is created from the file, as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxq.api.errors import ApiError, bad_request
from mlxq.errors import needs_extra

with needs_extra("api", "mlxq api"):
    import python_multipart  # noqa: F401  (Starlette needs it for uploads, imported late)
    from starlette.datastructures import UploadFile
    from starlette.requests import Request

DEFAULT_MAX_UPLOAD_BYTES = 200 * 1024 * 1024
DEFAULT_MAX_LINES = 50_000
# Room for the multipart framing and the `purpose` field around the file itself.
FORM_OVERHEAD = 64 * 1024
PURPOSES = ("batch",)


class _TooLarge(Exception):
    """The request body went past the limit while it was being received."""


@dataclass
class Upload:
    """A received file."""

    content: bytes
    filename: str
    purpose: str


def too_large(max_bytes: int) -> ApiError:
    """OpenAI-shaped 413 for an upload over ``max_bytes``."""
    return ApiError(
        413,
        f"File too large: this server accepts files of at most {max_bytes} bytes "
        f"({max_bytes / 2**20:.0f} MiB); split the input into several batches",
        param="file",
        code="file_too_large",
    )


async def read_upload(request: Request, *, max_bytes: int, max_lines: int) -> Upload:
    """The file and purpose of a ``POST /v1/files`` request, checked against the limits."""
    limit = max_bytes + FORM_OVERHEAD
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(max_bytes)
    counted = Request(request.scope, _limited_receive(request.receive, limit))
    try:
        async with counted.form(max_files=1, max_fields=8) as form:
            purpose, file = form.get("purpose"), form.get("file")
            if not isinstance(file, UploadFile):
                raise bad_request(
                    "Missing file: send it as the multipart field 'file'", param="file"
                )
            content = await file.read()
            filename = file.filename or "upload.jsonl"
    except _TooLarge:
        raise too_large(max_bytes) from None
    _check(content, purpose, max_bytes, max_lines)
    return Upload(content=content, filename=filename, purpose=str(purpose))


def _check(content: bytes, purpose: Any, max_bytes: int, max_lines: int) -> None:
    if purpose not in PURPOSES:
        raise bad_request(
            f"Invalid purpose {purpose!r}: this server takes files with purpose 'batch'",
            param="purpose",
        )
    if len(content) > max_bytes:
        raise too_large(max_bytes)
    if not content.strip():
        raise bad_request("The file is empty: give one JSON request per line", param="file")
    lines = count_lines(content)
    if lines > max_lines:
        raise bad_request(
            f"Too many requests: the file has {lines} lines and a batch takes at most "
            f"{max_lines}; split it into several files",
            param="file",
            code="too_many_lines",
        )


def count_lines(content: bytes) -> int:
    """How many non-blank lines ``content`` has."""
    return sum(1 for line in content.split(b"\n") if line.strip())


def _limited_receive(receive: Any, limit: int) -> Any:
    """``receive`` that raises :class:`_TooLarge` once more than ``limit`` body bytes came."""
    seen = 0

    async def limited() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge
        return message

    return limited
