"""Weight format per backend: quantized weights dequantized at load on CUDA, and on the CPU
when a timed layer says it is faster; kept on Metal."""

from __future__ import annotations

import logging
import re

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlxq.engine.models.make import build_model
from mlxq.engine.models.weights import dequantized_bytes, prepare_weights


def quantized_tiny() -> nn.Module:
    model, _ = build_model("tiny")
    nn.quantize(model, group_size=32, bits=8)
    return model


def linear_kinds(model: nn.Module) -> set[str]:
    return {type(m).__name__ for _, m in model.named_modules() if "Linear" in type(m).__name__}


def test_auto_keeps_quantized_weights_off_cuda(caplog: pytest.LogCaptureFixture) -> None:
    model = quantized_tiny()
    with caplog.at_level(logging.INFO, logger="mlxq.engine"):
        out = prepare_weights(model, "metal", 1 << 34, "auto")
    assert linear_kinds(out) == {"QuantizedLinear"}
    assert "kept quantized (metal has fast quantized kernels)" in caplog.text


def test_auto_dequantizes_on_cuda_when_it_fits(caplog: pytest.LogCaptureFixture) -> None:
    model = quantized_tiny()
    tokens = mx.array([[5, 6, 7, 8]])
    before = model(tokens)
    need = dequantized_bytes(model)
    assert need > 0
    with caplog.at_level(logging.INFO, logger="mlxq.engine"):
        kept = prepare_weights(model, "cuda", need, "auto")  # needs 2x: does not fit
        assert linear_kinds(kept) == {"QuantizedLinear"} and "exceeds 50%" in caplog.text
        out = prepare_weights(model, "cuda", 4 * need, "auto")
    assert linear_kinds(out) == {"Linear"} and "dequantizing" in caplog.text
    assert mx.allclose(out(tokens), before, atol=1e-4).item()  # the same model, unpacked


def test_on_and_off_override_the_backend() -> None:
    assert linear_kinds(prepare_weights(quantized_tiny(), "cpu", 1, "on")) == {"Linear"}
    off = prepare_weights(quantized_tiny(), "cuda", 1 << 40, "off")
    assert linear_kinds(off) == {"QuantizedLinear"}
    with pytest.raises(ValueError, match="auto, on, off"):
        prepare_weights(quantized_tiny(), "cuda", 1, "maybe")


def test_cpu_auto_takes_the_fastest_measured_format(caplog: pytest.LogCaptureFixture) -> None:
    model = quantized_tiny()
    tokens = mx.array([[5, 6, 7, 8]])
    before = model(tokens)
    with caplog.at_level(logging.INFO, logger="mlxq.engine"):
        out = prepare_weights(model, "cpu", 1 << 34, "auto")
    timed = re.search(r"quantized ([\d.]+) ms, float32 ([\d.]+) ms", caplog.text)
    assert timed is not None, caplog.text  # the reason is the measurement, both timed
    assert "bfloat16" not in caplog.text  # it drifts on the CPU: never a candidate
    quantized_ms, float_ms = map(float, timed.groups())
    if "kept quantized" in caplog.text:  # (the log rounds: equal figures allow either)
        assert linear_kinds(out) == {"QuantizedLinear"} and quantized_ms <= float_ms
        return
    assert linear_kinds(out) == {"Linear"} and "to float32" in caplog.text
    assert float_ms <= quantized_ms
    assert {p.dtype for _, p in tree_flatten(out.parameters())} == {mx.float32}
    assert mx.allclose(out(tokens), before, atol=1e-4).item()


def test_cpu_auto_keeps_quantized_weights_when_no_float_copy_fits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = quantized_tiny()
    with caplog.at_level(logging.INFO, logger="mlxq.engine"):
        out = prepare_weights(model, "cpu", dequantized_bytes(model, mx.bfloat16), "auto")
    assert linear_kinds(out) == {"QuantizedLinear"}
    assert "kept quantized" in caplog.text and "over 50% of memory left out" in caplog.text
