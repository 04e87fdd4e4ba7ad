"""The outcome of one request, and the entries of its token stream."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

FinishReason = Literal["stop", "length", "error", "cancelled", "timeout", "expired"]


class StreamEntry(Struct, omit_defaults=True):
    """One entry of a job's token stream: new text and ids, or the end of the job."""

    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None  # set on the last entry only


class StreamChunk(Struct):
    """New output of a ``stream: true`` job since its last chunk, as the engine hands it to
    the worker (which appends it to the job's stream as a :class:`StreamEntry`)."""

    key: str  # the job's id
    text: str
    token_ids: list[int]


class Usage(Struct):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Struct, array_like=True):
    """One alternative token and its logprob, encoded as ``[token_id, logprob]``."""

    token_id: int
    logprob: float


class TokenLogprob(Struct):
    """The chosen token's logprob and, if asked for, the top-n alternatives.

    ``bytes`` is the chosen token's UTF-8 bytes and ``top_bytes`` each alternative's, in
    the order of ``top`` (both null where unknown, as in results from before them). A token
    can hold part of a multi-byte character: the tokens' bytes joined are the text's.
    """

    token_id: int
    logprob: float
    top: list[TopLogprob] = []
    bytes: list[int] | None = None
    top_bytes: list[list[int]] | None = None


class Timing(Struct):
    """Timestamps (Unix seconds) and rates of one request.

    ``queue_wait_s`` is enqueue to start of work; ``ttft_s`` is start of work to first
    token; ``prefill_tps`` is prompt tokens over prefill time; ``decode_tps`` is generated
    tokens (after the first) over the time from first to last token.
    """

    enqueued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    queue_wait_s: float | None = None
    ttft_s: float | None = None
    prefill_tps: float | None = None
    decode_tps: float | None = None


class Choice(Struct):
    """One sample of a request with ``n`` > 1: its output and why it ended."""

    index: int
    finish_reason: FinishReason
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] | None = None


class Result(Struct, omit_defaults=False):
    """The outcome of one request, stored as its RQ job's return value.

    ``finish_reason`` is ``stop`` (EOS or a stop string), ``length`` (``max_tokens``),
    ``error`` (see ``error``), ``cancelled``, ``timeout`` (the job's wall-clock limit) or
    ``expired`` (its batch expired before it ran).

    A request with ``n`` > 1 has ``choices``, one per sample in order; ``text``,
    ``token_ids``, ``logprobs`` and ``finish_reason`` are then those of choice 0 (a job
    stopped as a whole says why instead), and ``usage.completion_tokens`` counts every
    choice's tokens. With ``n`` = 1, ``choices`` is null.
    """

    job_id: str
    custom_id: str | None
    finish_reason: FinishReason
    text: str = ""
    token_ids: list[int] = []
    usage: Usage = msgspec.field(default_factory=lambda: Usage(0, 0, 0))
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    model: str | None = None
    worker: str | None = None
    batch_id: str | None = None
    index: int | None = None
    metadata: dict[str, Any] = {}
    timing: Timing = msgspec.field(default_factory=Timing)
    choices: list[Choice] | None = None


result_decoder = msgspec.json.Decoder(Result)
