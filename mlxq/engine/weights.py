"""Per-backend weight format: quantized weights are dequantized at load on CUDA.

MLX's CUDA quantized matmul is slow for wide batches (an 8B shape at 4 bits ran 294 gen
tok/s against 7,229 in bf16 at batch 256 on an H200, issue 10), while Metal's quantized
kernels are fast and Macs are short of memory. So ``"auto"`` dequantizes on CUDA when the
dequantized weights take at most :data:`DEQUANTIZE_SHARE` of device memory, and keeps
them quantized elsewhere; ``"on"`` and ``"off"`` force it. The decision is logged.
"""

from __future__ import annotations

import logging

import mlx.nn as nn
from mlx_lm.utils import dequantize_model

log = logging.getLogger("mlxq.engine")
DEQUANTIZE_MODES = ("auto", "on", "off")
# "auto" dequantizes only if the full-precision weights fit in this share of memory.
DEQUANTIZE_SHARE = 0.5


def _quantized(model: nn.Module) -> list[nn.Module]:
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return [m for _, m in model.named_modules() if isinstance(m, kinds)]


def dequantized_bytes(model: nn.Module) -> int:
    """Bytes the quantized layers' weights would take dequantized (in their scales' dtype)."""
    total = 0
    for m in _quantized(model):
        rows, packed = m.weight.shape[0], m.weight.shape[-1]
        total += rows * packed * (32 // m.bits) * m.scales.dtype.size
    return total


def prepare_weights(model: nn.Module, backend: str, memory_bytes: int, mode: str) -> nn.Module:
    """The model with its weights in the format chosen for this backend (see module doc)."""
    if mode not in DEQUANTIZE_MODES:
        raise ValueError(f"dequantize must be one of {', '.join(DEQUANTIZE_MODES)}, not {mode!r}")
    layers = _quantized(model)
    if not layers:
        return model
    need = dequantized_bytes(model)
    fits = need <= DEQUANTIZE_SHARE * memory_bytes
    if mode == "on" or (mode == "auto" and backend == "cuda" and fits):
        log.info(
            "weights: dequantizing %d quantized layers at load (%.2f GiB; %s, dequantize=%s)",
            len(layers),
            need / 2**30,
            backend,
            mode,
        )
        return dequantize_model(model)
    if mode == "off":
        why = "dequantize=off"
    elif backend != "cuda":
        why = f"{backend} has fast quantized kernels"
    else:
        why = f"{need / 2**30:.1f} GiB dequantized exceeds {DEQUANTIZE_SHARE:.0%} of memory"
    log.info("weights: kept quantized (%s)", why)
    return model
