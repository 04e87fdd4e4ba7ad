"""Per-backend weight format: quantized weights are dequantized at load where that is faster.

MLX's CUDA quantized matmul is slow for wide batches, and so is its CPU one (over ten times
slower than the dequantized weights: figures in bench/RESULTS.md), while Metal's quantized
kernels are fast and Macs are short of memory. So ``"auto"``:

- on CUDA dequantizes when the dequantized weights take at most :data:`DEQUANTIZE_SHARE` of
  device memory;
- on the CPU times one of the model's own layers at load, quantized and in float32, and
  takes the faster whose weights fit that share (the timings are logged);
- elsewhere keeps them quantized.

``"on"`` and ``"off"`` force it. The decision is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model

log = logging.getLogger("mlxq.engine")
DEQUANTIZE_MODES = ("auto", "on", "off")
# "auto" dequantizes only if the full-precision weights fit in this share of memory.
DEQUANTIZE_SHARE = 0.5
# The CPU's candidates. Not float16 (no fast CPU path), nor bfloat16: a bfloat16 copy drifted
# on the CPU (SmolLM2 answered "L'Étoile, la Marseillaise" for Paris) and was ~4x slower than
# float32 through OpenBLAS anyway, winning only in noisy timings of a loaded machine.
CPU_DTYPES = (mx.float32,)
PROBE_ROWS = 8  # tokens per timed matmul: a small decode batch
# Where MLX's CPU quantized matmul is slow it is very slow (about 40 MFLOP/s here), so the
# probe times the smallest layer: a 4096x1024 one is ~1 s, an embedding 49152x576 was 12 s.


def _quantized(model: nn.Module) -> list[nn.Module]:
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return [m for _, m in model.named_modules() if isinstance(m, kinds)]


def _elements(m: nn.Module) -> int:
    return m.weight.shape[0] * m.weight.shape[-1] * (32 // m.bits)


def dequantized_bytes(model: nn.Module, dtype: mx.Dtype | None = None) -> int:
    """Bytes the quantized layers' weights would take dequantized (in ``dtype``, else in
    their scales' dtype)."""
    return sum(_elements(m) * (dtype or m.scales.dtype).size for m in _quantized(model))


def prepare_weights(model: nn.Module, backend: str, memory_bytes: int, mode: str) -> nn.Module:
    """The model with its weights in the format chosen for this backend (see module doc)."""
    if mode not in DEQUANTIZE_MODES:
        raise ValueError(f"dequantize must be one of {', '.join(DEQUANTIZE_MODES)}, not {mode!r}")
    layers = _quantized(model)
    if not layers:
        return model
    budget = DEQUANTIZE_SHARE * memory_bytes
    if mode == "auto" and backend == "cpu":
        dtype, why = cpu_choice(model, budget)
        if dtype is None:
            log.info("weights: kept quantized (%s)", why)
            return model
        return _dequantize(model, dtype, f"cpu, {why}")
    need = dequantized_bytes(model)
    if mode == "on" or (mode == "auto" and backend == "cuda" and need <= budget):
        return _dequantize(model, None, f"{backend}, dequantize={mode}")
    if mode == "off":
        why = "dequantize=off"
    elif backend != "cuda":
        why = f"{backend} has fast quantized kernels"
    else:
        why = f"{need / 2**30:.1f} GiB dequantized exceeds {DEQUANTIZE_SHARE:.0%} of memory"
    log.info("weights: kept quantized (%s)", why)
    return model


def _dequantize(model: nn.Module, dtype: mx.Dtype | None, why: str) -> nn.Module:
    layers, need = len(_quantized(model)), dequantized_bytes(model, dtype)
    if dtype is not None:  # unpacked in the target dtype, not rounded through float16 first
        for m in _quantized(model):
            m.scales = m.scales.astype(dtype)
            if m.get("biases") is not None:
                m.biases = m.biases.astype(dtype)
    model = dequantize_model(model)
    if dtype is not None:
        model.set_dtype(dtype)
    log.info(
        "weights: dequantizing %d quantized layers at load to %s (%.2f GiB; %s)",
        layers,
        str(dtype or "their scales' dtype").removeprefix("mlx.core."),
        need / 2**30,
        why,
    )
    return model


def cpu_choice(model: nn.Module, budget: float) -> tuple[mx.Dtype | None, str]:
    """The float dtype to dequantize to on the CPU (None: stay quantized), and why: the
    model's smallest quantized linear layer timed for :data:`PROBE_ROWS` tokens each way."""
    linear = [m for m in _quantized(model) if isinstance(m, nn.QuantizedLinear)]
    layer = min(linear or _quantized(model), key=_elements)
    timings = {"quantized": _time(lambda x: _quantized_matmul(layer, x), layer, None)}
    for dtype in CPU_DTYPES:
        if dequantized_bytes(model, dtype) <= budget:
            name = str(dtype).removeprefix("mlx.core.")
            timings[name] = _time(_float_matmul(layer, dtype), layer, dtype)
    best = min(timings, key=timings.__getitem__)
    shape = f"{layer.weight.shape[0]}x{_elements(layer) // layer.weight.shape[0]}"
    measured = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timings.items())
    why = f"measured a {shape} layer x {PROBE_ROWS} tokens: {measured}"
    if len(timings) < 1 + len(CPU_DTYPES):
        why += f"; float copies over {DEQUANTIZE_SHARE:.0%} of memory left out"
    return (None if best == "quantized" else getattr(mx, best)), why


def _quantized_matmul(layer: nn.Module, x: mx.array) -> mx.array:
    return mx.quantized_matmul(
        x,
        layer.weight,
        layer.scales,
        layer.get("biases"),
        transpose=True,
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    )


def _float_matmul(layer: nn.Module, dtype: mx.Dtype) -> Callable[[mx.array], mx.array]:
    w = mx.dequantize(
        layer.weight,
        layer.scales,
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=getattr(layer, "mode", "affine"),
    ).astype(dtype)
    mx.eval(w)
    return lambda x: x @ w.T


def _time(fn: Callable[[mx.array], mx.array], layer: nn.Module, dtype: mx.Dtype | None) -> float:
    """Best of a few timed runs of ``fn`` on random activations, in seconds."""
    cols = _elements(layer) // layer.weight.shape[0]
    x = mx.random.normal((PROBE_ROWS, cols)).astype(dtype or layer.scales.dtype)
    mx.eval(fn(x))  # warm up (and build) once
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        mx.eval(fn(x))
        best = min(best, time.perf_counter() - start)
    return best
