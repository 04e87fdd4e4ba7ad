"""A model split by heads over the ranks: mlx-lm's ``shard()`` (tensor parallel).

Each rank holds its share of every attention and MLP projection (``shard_linear``: the
input projections split by output, the output projections by input, followed by an
``all_sum``) and so its share of the KV heads: the KV cache per token is split too.
The embedding, the norms and the LM head stay whole on every rank. Weights load lazily,
so a rank reads only its share (mlx-lm's ``sharded_load`` does the same).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgspec

from mlxq.engine.models.source import load_model
from mlxq.errors import StartupError
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


def load_sharded(
    name: str, path: Path, adapter_path: str | None, group: mx.distributed.Group
) -> tuple[Any, Any]:
    """The model and tokenizer with this rank's share of the weights loaded; a
    :class:`StartupError` in one line if it cannot be split over the group."""
    if adapter_path is not None:
        raise StartupError(
            "a LoRA adapter cannot be split over ranks yet: fuse it into the model "
            "(`mlx_lm.fuse`) and serve the fused model"
        )
    model, tokenizer = load_model(name, path, lazy=True)
    why = unshardable(model, group.size())
    if why is not None:
        raise StartupError(
            f"model {name} cannot be split over {group.size()} ranks: {why}; pick a "
            "number of hosts that divides its heads, or another model"
        )
    model.shard(group)
    mx.eval(model.parameters())
    return model, tokenizer


def rank_info(info: ModelInfo, size: int) -> ModelInfo:
    """A rank's share of a sharded model's facts: its KV heads and KV bytes per token
    (the weights in ``info`` are already the rank's, counted after sharding)."""
    return msgspec.structs.replace(
        info,
        num_kv_heads=info.num_kv_heads // size,
        kv_bytes_per_token=info.kv_bytes_per_token // size,
    )
