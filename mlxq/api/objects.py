"""The API's objects as msgspec Structs: OpenAI's File and Batch, and what mlxq stores.

The public Structs (:class:`FileObject`, :class:`Batch`) encode to exactly OpenAI's JSON.
A batch is stored as a :class:`BatchState`: the public object plus the mlxq batch it
submitted, its queue and how it is ending, which never leave the server.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec
from msgspec import Struct

BatchStatusName = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
FINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
# How a batch that stops early ends: cancelled by its owner, or past its completion window.
Ending = Literal["cancelled", "expired"]

COMPLETION_WINDOWS = {"24h": 24 * 3600}


class FileObject(Struct, omit_defaults=False):
    """OpenAI's File object."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class RequestCounts(Struct):
    """How many requests a batch has, and how many have completed or failed."""

    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(Struct):
    """One problem with a batch's input file (``line`` is 1-based, when it is about a line)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(Struct):
    """OpenAI's ``errors`` list of a batch that failed validation."""

    data: list[BatchError] = []
    object: str = "list"


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class BatchUsage(Struct):
    """Token totals of a finished batch's requests."""

    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class Batch(Struct, omit_defaults=False):
    """OpenAI's Batch object (timestamps are Unix seconds)."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatusName
    created_at: int
    expires_at: int | None = None
    object: str = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None
    usage: BatchUsage | None = None


class BatchState(Struct):
    """What is stored per batch: the public object and the server's own bookkeeping."""

    batch: Batch
    mlxq_batch_id: str | None = None
    queue: str | None = None
    ending: Ending | None = None
    # Whether every request was enqueued (until then the batch's lock is held by the
    # process validating it).
    submitted: bool = False
    # The tenant that created it (``mlxq.api.auth.Tenant.owner``); None without auth.
    owner: str | None = None


state_decoder = msgspec.json.Decoder(BatchState)
file_decoder = msgspec.json.Decoder(FileObject)
encoder = msgspec.json.Encoder()


def now() -> int:
    """The current time in whole Unix seconds, as OpenAI's objects carry it."""
    return int(time.time())


def new_file_id() -> str:
    """A fresh file id, shaped like OpenAI's."""
    return "file-" + uuid.uuid4().hex[:24]


def new_batch_id() -> str:
    """A fresh batch id, shaped like OpenAI's."""
    return "batch_" + uuid.uuid4().hex


def output_file_id(batch_id: str, kind: Literal["output", "error"]) -> str:
    """The id of a batch's output or error file.

    Derived from the batch id, so a finalization that is interrupted and run again (by
    this process or another) writes the same files instead of leaving orphans.
    """
    return f"file-{batch_id.removeprefix('batch_')}-{kind}"


def to_builtins(obj: Any) -> Any:
    """An object as plain JSON values (for responses)."""
    return msgspec.to_builtins(obj)
