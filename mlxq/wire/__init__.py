"""Wire types: every structure that crosses Redis or a file, as msgspec Structs.

Everything mlxq writes is JSON encoded from these types, so any language can read it.
Constraints live in the types (``Meta``), so a bad value fails at decode time with the
field's name in the error.
"""

from __future__ import annotations

import msgspec

from mlxq.wire.records import (
    BatchInfo,
    BatchModel,
    BatchStatus,
    JobMeta,
    ModelInfo,
    ModelProgress,
    QueueInfo,
    SeenModel,
    WorkerInfo,
)
from mlxq.wire.request import (
    MAX_LOGPROBS,
    MAX_SAMPLES,
    MAX_TOKENS_LIMIT,
    Message,
    Request,
    request_decoder,
)
from mlxq.wire.response_format import (
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    RegexFormat,
    ResponseFormat,
    TextFormat,
)
from mlxq.wire.result import (
    Choice,
    FinishReason,
    Result,
    StreamChunk,
    StreamEntry,
    Timing,
    TokenLogprob,
    TopLogprob,
    Usage,
    result_decoder,
)

# One shared encoder: building it once is much faster than per call.
json_encoder = msgspec.json.Encoder()

__all__ = [
    "MAX_LOGPROBS",
    "MAX_SAMPLES",
    "MAX_TOKENS_LIMIT",
    "BatchInfo",
    "BatchModel",
    "BatchStatus",
    "Choice",
    "FinishReason",
    "GrammarFormat",
    "JobMeta",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "Message",
    "ModelInfo",
    "ModelProgress",
    "QueueInfo",
    "RegexFormat",
    "Request",
    "ResponseFormat",
    "Result",
    "SeenModel",
    "StreamChunk",
    "StreamEntry",
    "TextFormat",
    "Timing",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "WorkerInfo",
    "json_encoder",
    "request_decoder",
    "result_decoder",
]
