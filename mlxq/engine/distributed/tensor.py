"""A model split by heads over the ranks: mlx-lm's ``shard()`` (tensor parallel).

Each rank holds its share of every attention and MLP projection (``shard_linear``: the
input projections split by output, the output projections by input, followed by an
``all_sum``) and so its share of the KV heads: the KV cache per token is split too.
The embedding, the norms and the LM head stay whole on every rank. Weights load lazily,
so a rank reads only its share (mlx-lm's ``sharded_load`` does the same).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import msgspec

from mlxq.engine.models.facts import COLLECTIVES
from mlxq.wire import ModelInfo

# Model args that shard() divides by the number of ranks.
_SPLIT = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def unshardable(model: nn.Module, size: int) -> str | None:
    """Why ``model`` cannot be split over ``size`` ranks by heads, or None."""
    if not callable(getattr(model, "shard", None)):
        kind = type(model).__module__.rsplit(".", 1)[-1]
        return f"mlx-lm's {kind} models have no shard() (tensor parallel)"
    args = vars(getattr(model, "args", object()))
    for name in _SPLIT:
        value = args.get(name)
        if isinstance(value, int) and value % size:
            return f"its {name} ({value}) is not divisible by {size} ranks"
    return None


def shard(model: nn.Module, group: mx.distributed.Group) -> None:
    """Keep this rank's share of every layer (``unshardable`` said it can), loaded; the
    model is marked as running collectives (:data:`~mlxq.engine.models.facts.COLLECTIVES`)."""
    model.shard(group)
    mx.eval(model.parameters())
    setattr(model, COLLECTIVES, True)


def rank_info(info: ModelInfo, size: int) -> ModelInfo:
    """A rank's share of a sharded model's facts: its KV heads and KV bytes per token
    (the weights in ``info`` are already the rank's, counted after sharding)."""
    return msgspec.structs.replace(
        info,
        num_kv_heads=info.num_kv_heads // size,
        kv_bytes_per_token=info.kv_bytes_per_token // size,
    )
