"""A model split by layers over the ranks (pipeline parallel): each rank one stage.

The stages run in the order rank 1, 2, ..., then rank 0: rank 0 (the RQ worker) holds the
last layers, the final norm and the LM head, so it samples and has the real logits
(logprobs, constraints); rank 1 holds the embedding and the first layers. A stage gets
its input from the stage before (``recv``, on the compute stream, so the layers wait for
it) and sends its output to the next one as soon as it is computed (``send``, started at
once with ``async_eval``: the prefill, which evaluates only the cache, and the decode
step alike). The KV cache of a rank holds only its layers.

mlx-lm's models reach the layers through ``model.model`` (``embed_tokens``, ``layers``,
``norm``), and their ``__call__`` takes ``input_embeddings`` (llama, qwen2, qwen3,
mistral, ...): a stage keeps its slice of ``layers``, and a stage before the last one
swaps the final norm for the identity. Weights load lazily, so a rank reads only what
its stage evaluates.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgspec

from mlxq.engine.distributed.relay import MAX_RANKS
from mlxq.wire import ModelInfo


@dataclass(frozen=True)
class StageRole:
    """Where this rank's stage sits in the pipeline."""

    group: mx.distributed.Group
    first: bool  # embeds the tokens
    last: bool  # norm and LM head (rank 0)
    prev: int  # rank its input comes from (unused by the first stage)
    next: int  # rank its output goes to (unused by the last)
    dtype: mx.Dtype  # of the activations sent between stages
    hidden: int
    largest: int  # layers of the largest stage


def stage_order(size: int) -> list[int]:
    """The ranks in pipeline order: rank 0, which samples, last."""
    return [*range(1, size), 0]


def layer_spans(layers: int, size: int) -> list[tuple[int, int]]:
    """Each pipeline position's layers ``[start, end)``, as even as they divide."""
    base, extra = divmod(layers, size)
    spans, at = [], 0
    for i in range(size):
        n = base + (i < extra)
        spans.append((at, at + n))
        at += n
    return spans


def unpipelinable(model: nn.Module, size: int) -> str | None:
    """Why ``model`` cannot be split by layers over ``size`` ranks, or None."""
    inner = getattr(model, "model", None)
    kind = type(model).__module__.rsplit(".", 1)[-1]
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return f"mlx-lm's {kind} models keep their layers elsewhere than model.model"
    if "input_embeddings" not in inspect.signature(type(model).__call__).parameters:
        return f"mlx-lm's {kind} models take no input_embeddings (a stage's input)"
    if len(inner.layers) < size:
        return f"it has {len(inner.layers)} layers, fewer than {size} ranks"
    if size > MAX_RANKS:
        return f"a pipeline spans at most {MAX_RANKS} ranks (each reaches only its neighbours)"
    return None


class _Stage:
    """The ``__call__`` of a model made a stage (mixed into its class by :func:`make_stage`)."""

    _stage: StageRole

    def __call__(
        self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        role = self._stage
        if not role.first:
            shape = (*inputs.shape, role.hidden)
            input_embeddings = mx.distributed.recv(shape, role.dtype, role.prev, group=role.group)
        if role.last:
            return super().__call__(inputs, cache, input_embeddings)  # type: ignore[misc]
        h = self.model(inputs, cache, input_embeddings)  # type: ignore[attr-defined]
        sent = mx.distributed.send(h.astype(role.dtype), role.next, group=role.group)
        mx.async_eval(sent)  # (now, in step order: the next stage waits for it)
        return sent


def make_stage(model: nn.Module, group: mx.distributed.Group) -> StageRole:
    """Cut ``model`` down to this rank's stage, in place; its role."""
    rank, size = group.rank(), group.size()
    order = stage_order(size)
    at = order.index(rank)
    inner = model.model
    spans = layer_spans(len(inner.layers), size)
    start, end = spans[at]
    first_layer = inner.layers[start]
    inner.layers = inner.layers[start:end]
    if at < size - 1:
        inner.norm = nn.Identity()
    role = StageRole(
        group=group,
        first=at == 0,
        last=at == size - 1,
        prev=order[at - 1] if at else -1,
        next=order[at + 1] if at < size - 1 else -1,
        dtype=_activation_dtype(first_layer),
        hidden=int(model.args.hidden_size),
        largest=max(b - a for a, b in spans),
    )
    model.__class__ = type(f"Stage{type(model).__name__}", (_Stage, type(model)), {})
    model._stage = role  # (a plain attribute: not a parameter)
    return role


def stage_info(info: ModelInfo, model: nn.Module) -> ModelInfo:
    """The facts that size a stage's batch: ``info`` (of this rank's stage) with the
    layers, and so the KV bytes per token, of the largest stage, which every rank's
    memory must hold."""
    largest = model._stage.largest
    per_layer = info.kv_bytes_per_token // max(1, info.num_layers)
    return msgspec.structs.replace(info, num_layers=largest, kv_bytes_per_token=per_layer * largest)


def _activation_dtype(layer: nn.Module) -> mx.Dtype:
    """The dtype a layer computes in: its first floating parameter's (a norm's weight)."""
    norm = getattr(layer, "input_layernorm", None)
    weight = getattr(norm, "weight", None)
    if isinstance(weight, mx.array):
        return weight.dtype
    for _, v in nn.utils.tree_flatten(layer.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float16


def stage(model: nn.Module, group: mx.distributed.Group) -> StageRole:
    """Cut ``model`` to this rank's stage (``unpipelinable`` said it can) and load what
    the stage uses; its role."""
    role = make_stage(model, group)
    inner = model.model
    needed: list[Any] = [layer.parameters() for layer in inner.layers]
    head = model.get("lm_head")  # (absent where the head is the embedding, tied)
    if role.first or (role.last and head is None):
        needed.append(inner.embed_tokens.parameters())
    if role.last:
        needed.append(inner.norm.parameters())
        if head is not None:
            needed.append(head.parameters())
    mx.eval(needed)
    return role
