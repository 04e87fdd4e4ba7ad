"""Where the slot engine meets mlx-lm's model modules: the one place with private detail.

mlx-lm's attention layers (llama, qwen2, qwen3, mistral, phi3, ...; mlx-lm 0.32) use a cache
through three calls: ``cache.offset`` (RoPE), ``cache.update_and_fetch(k, v)`` and
``create_attention_mask(h, cache)`` (which calls ``cache.make_mask``); then they call
``scaled_dot_product_attention`` imported from ``mlx_lm.models.base`` into their own
module. That last call is not a cache method, so :func:`install` rebinds the name in the
model's modules to :func:`_sdpa`, which hands a cache layer that attends itself
(:class:`AttendingCache`: the slot cache's :class:`~mlxq.engine.slots.cache.SlotLayer`,
the CPU prefill's :class:`~mlxq.engine.slots.causal_blocks.BlockedCache`) its queries and
the model's mask, and passes every other cache through to mlx-lm's function unchanged
(other engines and plain mlx-lm calls behave as before). The slot cache depends on this module,
never the other way round.

Their MLPs call ``swiglu``, imported from ``mlx_lm.models.activations`` the same way:
:func:`install` rebinds it to :func:`_swiglu`, which calls the one that
:func:`activations` chose for the thread (the slot engine's steps choose theirs,
:mod:`~mlxq.engine.slots.silu`), else mlx-lm's.

:func:`unsupported` says why a model cannot run on slot caches (or None): its cache must
be a plain ``KVCache`` per layer (no sliding window, no SSM state, no MLA latent cache)
and its attention must go through a rebindable ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations as mlx_activations
from mlx_lm.models import base
from mlx_lm.models.cache import KVCache, make_prompt_cache

_ORIGINAL = base.scaled_dot_product_attention
_NAME = "scaled_dot_product_attention"
_ORIGINAL_SWIGLU = mlx_activations.swiglu
_SWIGLU = "swiglu"
_chosen = threading.local()  # .swiglu: this thread's, while activations() holds


class AttendingCache:
    """A cache layer that computes its layer's attention itself (from the queries and the
    model's mask: its keys and values are its own); :func:`_sdpa` hands it the call."""

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention of ``queries`` over the layer's cached keys and values; ``mask`` is
        what the model passed (mlx-lm's ``"causal"``, an array, or None)."""
        raise NotImplementedError


def _sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    if isinstance(cache, AttendingCache) and sinks is None:
        return cache.attend(queries, scale, mask)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _model_modules(model: nn.Module) -> list[Any]:
    """The Python modules that define the model's layers (the model may wrap them)."""
    names = {type(m).__module__ for _, m in model.named_modules()}
    return [sys.modules[n] for n in sorted(names) if n in sys.modules]


def unsupported(model: nn.Module) -> str | None:
    """Why the slot engine cannot run this model, or None if it can."""
    try:
        caches = make_prompt_cache(model)
    except Exception as exc:  # a model without the usual layers
        return f"its cache cannot be made ({type(exc).__name__}: {exc})"
    kinds = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
    if kinds:
        return f"its cache is {', '.join(kinds)}, not a plain KVCache per layer"
    if not any(getattr(m, _NAME, None) in (_ORIGINAL, _sdpa) for m in _model_modules(model)):
        return "its attention does not call mlx_lm.models.base.scaled_dot_product_attention"
    return None


def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    chosen = getattr(_chosen, "swiglu", None)
    return (chosen or _ORIGINAL_SWIGLU)(gate, x)


@contextlib.contextmanager
def activations(swiglu: Callable[[mx.array, mx.array], mx.array] | None) -> Iterator[None]:
    """Inside the block, the installed models' ``swiglu`` calls on this thread go to
    ``swiglu`` (None: mlx-lm's own); as before after it."""
    before = getattr(_chosen, "swiglu", None)
    _chosen.swiglu = swiglu
    try:
        yield
    finally:
        _chosen.swiglu = before


def uses_swiglu(model: nn.Module) -> bool:
    """Whether the model's modules call mlx-lm's ``swiglu`` (so :func:`activations` acts)."""
    return any(
        getattr(m, _SWIGLU, None) in (_ORIGINAL_SWIGLU, _swiglu) for m in _model_modules(model)
    )


def install(model: nn.Module) -> None:
    """Route the model's attention calls through :func:`_sdpa` and its ``swiglu`` calls
    through :func:`_swiglu` (idempotent)."""
    for module in _model_modules(model):
        if getattr(module, _NAME, None) is _ORIGINAL:
            setattr(module, _NAME, _sdpa)
        if getattr(module, _SWIGLU, None) is _ORIGINAL_SWIGLU:
            setattr(module, _SWIGLU, _swiglu)
