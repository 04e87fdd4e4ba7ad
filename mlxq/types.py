"""Wire types: every structure that crosses Redis or a file, as msgspec Structs.

Everything mlxq writes is JSON encoded from these types, so any language can read it.
Constraints live in the types (``Meta``), so a bad value fails at decode time with the
field's name in the error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

# Generous upper bounds that still catch typos (a max_tokens of 10**9 is never meant).
MAX_TOKENS_LIMIT = 1_000_000
MAX_LOGPROBS = 20

PositiveInt = Annotated[int, Meta(gt=0)]
TokenId = Annotated[int, Meta(ge=0)]

FinishReason = Literal["stop", "length", "error", "cancelled", "timeout", "expired"]


class Message(Struct, forbid_unknown_fields=True):
    """One chat message, rendered with the model's chat template."""

    role: Annotated[str, Meta(min_length=1)]
    content: str


class Request(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A generation request: exactly one of ``prompt`` (text or token ids) or ``messages``.

    Defaults: ``max_tokens`` 256; greedy decoding (``temperature`` 0, ``top_p`` 1,
    ``top_k`` 0 = off, ``min_p`` 0 = off); no repetition penalty; no stop strings; no
    logprobs. ``stop`` strings end generation and are not included in the text.
    ``logprobs`` asks for the top-n alternatives of every generated token (0 = only the
    chosen token's logprob). ``stream`` appends text to ``keys.stream(job_id)`` as it is
    generated, so a service can show partial output.
    """

    prompt: str | list[TokenId] | None = None
    messages: list[Message] | None = None
    max_tokens: Annotated[int, Meta(gt=0, le=MAX_TOKENS_LIMIT)] = 256
    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] = 0.0
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0)] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None
    stop: list[Annotated[str, Meta(min_length=1)]] = []
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    custom_id: Annotated[str, Meta(min_length=1, max_length=512)] | None = None
    metadata: dict[str, Any] = {}
    stream: bool = False  # append tokens to a Redis stream as they come (`mlxq tail`)

    def __post_init__(self) -> None:
        has_prompt = self.prompt is not None
        has_messages = self.messages is not None
        if has_prompt == has_messages:
            raise ValueError("give exactly one of `prompt` (text or token ids) or `messages`")
        if has_prompt and len(self.prompt) == 0:  # type: ignore[arg-type]
            raise ValueError("`prompt` is empty: give text or at least one token id")
        if has_messages and not self.messages:
            raise ValueError("`messages` is empty: give at least one message")


class StreamEntry(Struct, omit_defaults=True):
    """One entry of a job's token stream: new text and ids, or the end of the job."""

    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None  # set on the last entry only


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
    """The chosen token's logprob and, if asked for, the top-n alternatives."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = []


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


class Result(Struct, omit_defaults=False):
    """The outcome of one request, stored as its RQ job's return value.

    ``finish_reason`` is ``stop`` (EOS or a stop string), ``length`` (``max_tokens``),
    ``error`` (see ``error``), ``cancelled``, ``timeout`` (the job's wall-clock limit) or
    ``expired`` (its batch expired before it ran).
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


class JobMeta(Struct, omit_defaults=True):
    """What mlxq keeps in an RQ job's ``meta``: where the job belongs."""

    batch_id: str | None = None
    index: int | None = None
    custom_id: str | None = None
    expires_at: float | None = None  # Unix time after which the request is not run


class BatchInfo(Struct):
    """A submitted batch: its jobs are listed, in input order, under ``keys.batch_jobs``."""

    batch_id: str
    queue: str
    total: int
    created_at: float
    source: str | None = None
    model: str | None = None
    expires_at: float | None = None


class BatchStatus(Struct):
    """Counts of a batch's jobs by state."""

    batch_id: str
    total: int
    queued: int
    started: int
    finished: int
    failed: int
    cancelled: int = 0
    other: int = 0

    @property
    def done(self) -> int:
        """Jobs that will not change any more."""
        return self.finished + self.failed + self.cancelled


class ModelInfo(Struct):
    """Facts about a loaded model that scheduling and logs need (no MLX types)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    kv_bytes_per_token: int
    param_bytes: int
    dtype: str


class WorkerInfo(Struct):
    """What a live worker publishes about itself (``keys.worker_info``), refreshed with
    its heartbeat and expiring when the worker dies."""

    name: str
    host: str
    pid: int
    model: str
    queues: list[str]
    backend: str  # metal, cuda or cpu
    device: str
    memory_bytes: int
    max_batch: int
    kv_budget_bytes: int
    kv_reserved_bytes: int
    in_flight: int
    jobs_done: int
    jobs_failed: int
    tokens_generated: int
    recent_tps: float  # generated tokens/s over the last minute or so
    started_at: float
    heartbeat_at: float
    adapter_path: str | None = None


class QueueInfo(Struct):
    """One RQ queue at a glance (``mlxq status`` without a batch id).

    ``queued`` is the queue's length; ``started``, ``finished`` and ``failed`` are the
    sizes of RQ's registries for it (``started`` counts executions, one per running job).
    ``oldest_enqueued_at`` (Unix seconds) and ``oldest_age_s`` describe the longest-waiting
    queued job, or are None when the queue is empty. ``workers`` is how many live mlxq
    workers serve the queue.
    """

    name: str
    queued: int
    started: int
    finished: int
    failed: int
    oldest_enqueued_at: float | None
    oldest_age_s: float | None
    workers: int = 0


# Shared encoders/decoders: building them once is much faster than per call.
json_encoder = msgspec.json.Encoder()
request_decoder = msgspec.json.Decoder(Request)
result_decoder = msgspec.json.Decoder(Result)
