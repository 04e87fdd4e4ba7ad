"""Shape facts of a loaded mlx-lm model: layers, heads, KV bytes per token, weight bytes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxq.wire import ModelInfo

# Used when a model's config does not say how long its context is.
DEFAULT_CONTEXT_LENGTH = 32768


def model_info(model: nn.Module, name: str, vocab_size: int = 0) -> ModelInfo:
    """Shape facts of a loaded mlx-lm model, read from its ``args``.

    ``vocab_size`` is used when the args do not say (the tokenizer's size).
    """
    args = vars(model.args) if hasattr(model, "args") else {}
    if isinstance(args.get("text_config"), dict):  # multimodal models nest the LM's config
        args = {**args["text_config"], **args}
    layers = len(model.layers)
    hidden = args.get("hidden_size", 0)
    heads = args.get("num_attention_heads", 0)
    kv_heads = args.get("num_key_value_heads") or heads
    head_dim = args.get("head_dim") or (hidden // heads if heads else 0)
    params = [v for _, v in tree_flatten(model.parameters())]
    floats = [v.dtype for v in params if mx.issubdtype(v.dtype, mx.floating)]
    dtype = floats[0] if floats else mx.float16
    return ModelInfo(
        name=name,
        model_type=str(args.get("model_type", type(model).__module__.rsplit(".", 1)[-1])),
        num_layers=layers,
        hidden_size=hidden,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=args.get("vocab_size") or vocab_size,
        context_length=args.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype.size,
        param_bytes=sum(v.nbytes for v in params),
        dtype=str(dtype).rsplit(".", 1)[-1],
    )


# Set on a model whose forward runs collectives (tensor parallel's two ``all_sum`` a
# layer, mlxq.engine.distributed.tensor): every rank must run them in one order.
COLLECTIVES = "mlxq_runs_collectives"


def runs_collectives(model: nn.Module) -> bool:
    """Whether the model's forward runs collectives (see :data:`COLLECTIVES`)."""
    return bool(getattr(model, COLLECTIVES, False))
