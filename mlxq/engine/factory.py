"""Which engine runs a model: the slot engine where it can, else ``BatchGenerator``'s.

The slot engine (:mod:`mlxq.engine.slots.engine`) needs a plain KV cache per layer; models
with sliding-window layers (gemma3), SSM state (hybrids) or latent (MLA) caches run on
the ``BatchGenerator`` engine (:mod:`mlxq.engine.mlx_lm_batch`), with one log line saying
so. ``MLXQ_ENGINE=batch_generator`` (or ``engine="batch_generator"``) forces the fallback.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import mlx.nn as nn

from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine
from mlxq.engine.models import mlx_lm_seam
from mlxq.engine.protocol import BatchEngine
from mlxq.engine.slots.engine import SlotEngine

log = logging.getLogger("mlxq.engine")
ENGINE_ENV = "MLXQ_ENGINE"
ENGINES = ("slot", "batch_generator")


def make_engine(
    model: nn.Module, tokenizer: Any, name: str, *, engine: str | None = None, **options: Any
) -> BatchEngine:
    """The engine for a loaded model (options as ``SlotEngine.from_loaded``; the fallback
    ignores ``attention`` and ``prefill_tokens``, and refuses ``hooks`` and ``kv_bits``)."""
    choice = engine or os.environ.get(ENGINE_ENV) or "slot"
    if choice not in ENGINES:
        raise ValueError(
            f"unknown engine {choice!r} (from {ENGINE_ENV} or the options): "
            f"choose one of {', '.join(ENGINES)}"
        )
    why = mlx_lm_seam.unsupported(model) if choice == "slot" else f"{ENGINE_ENV}={choice}"
    if why is None:
        return SlotEngine.from_loaded(model, tokenizer, name, **options)
    log.info("engine: mlx-lm BatchGenerator for %s (%s)", name, why)
    if options.pop("kv_bits", None) is not None:  # its batched path cannot quantize its cache
        raise ValueError(
            f"kv_bits needs the slot engine, and {name} runs on mlx-lm's BatchGenerator "
            f"({why}): run it without kv_bits"
        )
    if options.pop("hooks", None):
        raise ValueError(f"batch logits hooks need the slot engine, and {name} cannot use it")
    options.pop("attention", None)
    options.pop("prefill_tokens", None)  # it sizes prefill from the arrivals alone
    return BatchGeneratorEngine.from_loaded(model, tokenizer, name, **options)
