"""Sibling projections of one input as one matmul: attention's q, k and v, the MLP's gate
and up.

On CUDA a decode step is host-bound, and each matmul is a cuBLAS call that costs the host
about 18 us to launch against about 5 us for another kernel (H200 host, MLX 0.32.4: 50
matmuls of a 256-row batch took 0.8-1.0 ms to launch). A Llama 3.2 1B step launches 145
of them; fusing the siblings removes 48 (three of nine per layer): its launch took 3.97
against 5.28 ms, and the uniform 256 x (128+128) run 1.09-1.13x the gen tok/s.

mlx-lm's model code stays as it is: it calls ``self.q_proj(x)``, ``self.k_proj(x)`` and
``self.v_proj(x)`` in turn. Each of those modules becomes a :class:`Part` of one
:class:`Fused` group, which computes ``x @ W^T`` for every part the first time a part is
called with ``x`` and hands each part its columns (views: no copy). The parts keep their
weights as views of the fused one, so the model's parameters read as before and no weight
is held twice. Only inputs of decode size are fused: a prefill's rows (more than
:data:`MAX_ROWS`) keep a matmul per part, because a launch is nothing beside a prefill's
compute, while parts of one output keep each other alive where separate outputs could be
reused in place (a 16 x 512-token prefill peaked 29% higher fused, on the CPU). Only plain
``nn.Linear`` siblings of one input size, all with or all without a bias, are fused: LoRA
and quantized layers stay as they are.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

FUSE_ENV = "MLXQ_FUSE_PROJECTIONS"
# Sibling groups by name: attention's, the MLP's.
SIBLINGS = {"attention": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
# What each setting fuses; where fusing is the default: CUDA, whose decode steps are
# host-bound (bench/RESULTS.md).
SETTINGS = {"1": ("attention", "mlp"), "attention": ("attention",), "0": ()}
DEFAULT = {"cuda": "1"}
MAX_ROWS = 2048  # the widest input (tokens) fused: decode batches, small prefills


class Fused:
    """Sibling projections' weights as one ``[sum of outputs, inputs]`` matrix."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        self.weight = mx.concatenate([layer.weight for layer in layers])
        has_bias = "bias" in layers[0]
        self.bias = mx.concatenate([layer.bias for layer in layers]) if has_bias else None
        self.sizes = [layer.weight.shape[0] for layer in layers]
        self.starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._x: mx.array | None = None
        self._outs: list[mx.array] = []
        self._taken: set[int] = set()

    def take(self, part: int, x: mx.array) -> mx.array:
        """Part ``part``'s projection of ``x``: all parts are computed at its first call
        with this ``x`` (a part asked twice, or another input, computes them again)."""
        if x is not self._x or part in self._taken:
            y = _project(x, self.weight, self.bias)
            self._x, self._outs, self._taken = x, mx.split(y, self.starts[1:], axis=-1), set()
        self._taken.add(part)
        out = self._outs[part]
        if len(self._taken) == len(self._outs):  # every part has its own: let x go
            self._x, self._outs = None, []
        return out


class Part(nn.Module):
    """One projection of a :class:`Fused` group, where mlx-lm's model calls it."""

    def __init__(self, group: Fused, index: int) -> None:
        super().__init__()
        self._group, self._index = group, index
        start, size = group.starts[index], group.sizes[index]
        self.weight = group.weight[start : start + size]  # a view, for readers of parameters
        if group.bias is not None:
            self.bias = group.bias[start : start + size]

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] > MAX_ROWS:  # a prefill: its own matmul (module docstring)
            return _project(x, self.weight, self.get("bias"))
        return self._group.take(self._index, x)


def _project(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """``x @ weight^T (+ bias)``, as ``nn.Linear`` computes it."""
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def wanted(backend: str) -> tuple[str, ...]:
    """The sibling groups to fuse on ``backend`` (``MLXQ_FUSE_PROJECTIONS``: 1 for all,
    ``attention`` for q, k and v only, 0 for none); raises ``ValueError`` for another value."""
    setting = os.environ.get(FUSE_ENV) or DEFAULT.get(backend, "0")
    if setting not in SETTINGS:
        raise ValueError(f"{FUSE_ENV}={setting!r}: choose one of {', '.join(SETTINGS)}")
    return SETTINGS[setting]


def fuse_projections(model: nn.Module, groups: tuple[str, ...] = ("attention", "mlp")) -> int:
    """Fuse the sibling projections of ``groups`` in ``model`` (in place; idempotent);
    returns how many it fused."""
    fused = 0
    for _, module in model.named_modules():
        for names in (SIBLINGS[g] for g in groups):
            layers = [module.get(name) for name in names]
            if _fusable(layers):
                group = Fused(layers)
                for i, name in enumerate(names):
                    module[name] = Part(group, i)
                # The views share the fused buffer once computed; the old weights go.
                mx.eval(group.weight, [module[name].parameters() for name in names])
                fused += 1
    return fused


def unfuse_projections(model: nn.Module) -> int:
    """Give ``model`` back plain ``nn.Linear`` projections (their weights stay views of
    the fused ones: no copy), e.g. to run it as mlx-lm built it; returns how many."""
    restored = 0
    for _, module in model.named_modules():
        for name, child in list(module.children().items()):
            if isinstance(child, Part):
                module[name] = _linear(child.weight, child.get("bias"))
                restored += 1
    return restored


def _linear(weight: mx.array, bias: mx.array | None) -> nn.Linear:
    """An ``nn.Linear`` holding these arrays (no random initialization to throw away)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.weight = weight
    if bias is not None:
        layer.bias = bias
    return layer


def _fusable(layers: list[Any]) -> bool:
    """Plain linear layers (not LoRA, not quantized) of one input size and dtype, all with
    a bias or all without."""
    if not all(type(layer) is nn.Linear for layer in layers):
        return False
    first = layers[0]
    return all(
        layer.weight.shape[1] == first.weight.shape[1]
        and layer.weight.dtype == first.weight.dtype
        and ("bias" in layer) == ("bias" in first)
        for layer in layers
    )
