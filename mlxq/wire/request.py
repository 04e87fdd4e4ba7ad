"""A generation request as producers send it (msgspec; constraints live in the types)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from mlxq.wire.response_format import ResponseFormat

# Generous upper bounds that still catch typos (a max_tokens of 10**9 is never meant).
MAX_TOKENS_LIMIT = 1_000_000
MAX_LOGPROBS = 20
# Samples of one request (OpenAI's ``n``): each takes a row of the batch.
MAX_SAMPLES = 128

TokenId = Annotated[int, Meta(ge=0)]


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
    generated, so a service can show partial output. ``response_format`` constrains the
    output to a JSON schema, any JSON object, a regex or a Lark grammar
    (:mod:`mlxq.wire.response_format`). ``n`` asks for that many samples of the one
    prompt (prefilled once), sample ``i`` seeded ``seed + i``; the result's ``choices``
    hold them (:class:`~mlxq.wire.result.Result`). ``n`` > 1 cannot stream. ``model``
    routes the request to that model's queue (``keys.queue_name_for_model``); without it
    the request goes to its batch's queue.
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
    response_format: ResponseFormat | None = None  # JSON schema, regex or grammar
    n: Annotated[int, Meta(ge=1, le=MAX_SAMPLES)] = 1  # samples of this prompt
    model: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None  # picks the queue

    def __post_init__(self) -> None:
        has_prompt = self.prompt is not None
        has_messages = self.messages is not None
        if has_prompt == has_messages:
            raise ValueError("give exactly one of `prompt` (text or token ids) or `messages`")
        if has_prompt and len(self.prompt) == 0:  # type: ignore[arg-type]
            raise ValueError("`prompt` is empty: give text or at least one token id")
        if has_messages and not self.messages:
            raise ValueError("`messages` is empty: give at least one message")
        if self.n > 1 and self.stream:
            raise ValueError(
                f"`stream` with `n` = {self.n}: a stream carries one sample; "
                "set `stream` to false or `n` to 1"
            )


request_decoder = msgspec.json.Decoder(Request)
