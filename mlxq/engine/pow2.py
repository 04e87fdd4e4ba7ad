"""``2 ** y`` on the CPU from a float's parts, where MLX's ``exp`` is slow.

MLX's CPU ``exp``, and what it builds on it (``mx.softmax``, ``mx.sigmoid``, ``nn.silu``),
took 13-27 ns an element here, on one thread a stream (bench/RESULTS.md). :func:`power`
takes ``2 ** y`` from its parts: the nearest whole number ``n`` becomes the float's
exponent bits, and ``2 ** (y - n)`` (within half a unit of 0) a degree-6 polynomial
(relative error 1.6e-7 in float32, as close as MLX's own ``exp``). Its work runs as two
kernels that MLX compiles (``mx.compile``; MLX runs them op by op where it has no C++
compiler, still faster than ``mx.exp``).

MLX 0.32 fuses a compiled function's operations into one kernel only up to a depth of 11
(a shapeless one's broadcasts count) and a single output; past either it splits the kernel
and keeps more intermediate arrays. So each kernel has one output and a few operations.

Two parts of a step take exponentials through it: the attention's softmax
(:mod:`~mlxq.engine.slots.softmax`) and the MLP's SiLU (:mod:`~mlxq.engine.slots.silu`).
Each builds its kernels before their first use in a process, one process at a time
(:func:`warm_once`, :mod:`~mlxq.engine.kernel_lock`).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Collection

import mlx.core as mx

from mlxq.engine.kernel_lock import building_kernels

LOG2E = 1 / math.log(2)
_ROUND = 12582912.0  # 1.5 * 2**23: added to a float under 2**22, rounds it to a whole number
# 2**r on |r| <= 0.5, a least-squares fit of relative error (1.9e-9; 1.6e-7 in float32)
_POLY = [
    1.000000001,
    0.6931472056,
    0.2402264661,
    0.05550328998,
    0.009618519534,
    0.001339986036,
    0.0001533757683,
]


def _whole(y: mx.array) -> mx.array:
    """The whole number nearest ``y`` (``_ROUND``'s last place is 1)."""
    return (y + _ROUND) - _ROUND


def _power_bits(y: mx.array) -> mx.array:
    """The float32 bits of ``2 ** n``, ``n`` the whole number nearest ``y`` (an int32 array
    to view as float32)."""
    return ((_whole(y) + 127.0) * float(1 << 23)).astype(mx.int32)  # (exact: 7 bits)


def _times_power(y: mx.array, scale: mx.array) -> mx.array:
    """``scale * 2 ** (y - n)``: the polynomial over ``|y - n| <= 0.5`` in Estrin's form."""
    c, r = _POLY, y - _whole(y)
    r2 = r * r
    high = (c[4] + c[5] * r) + r2 * c[6]
    return ((c[0] + c[1] * r) + r2 * (c[2] + c[3] * r) + (r2 * r2) * high) * scale


# Shapeless: a decode step's shapes change every step, and each traced shape would be kept.
_power_bits_c = mx.compile(_power_bits, shapeless=True)
_times_power_c = mx.compile(_times_power, shapeless=True)


def power(y: mx.array) -> mx.array:
    """``2 ** y`` of float32 ``y`` in ``[-127, 127]`` (``-127`` gives 0: no exponent bits).
    ``y`` is best an array a compiled kernel made: contiguous, one layout to build."""
    return _times_power_c(y, _power_bits_c(y).view(mx.float32))


_lock = threading.Lock()
_warmed: set[str] = set()


def warm_once(name: str, build: Callable[[], None]) -> None:
    """Run ``build`` (it evaluates every kernel layout a user of :func:`power` meets) the
    first time ``name`` asks in this process, holding the machine's kernel lock: MLX
    builds a kernel for each layout of its inputs at its first evaluation."""
    if name in _warmed:  # (once warm: no lock)
        return
    with _lock:
        if name in _warmed:
            return
        with building_kernels():
            build()
        _warmed.add(name)


def choose(env: str, backend: str, names: Collection[str]) -> str:
    """A user's choice between ``pow2`` and MLX's own (``names``): the setting ``env``,
    else ``pow2`` on the CPU and ``mlx`` elsewhere; raises ``ValueError`` for a setting
    that names none."""
    name = os.environ.get(env) or ("pow2" if backend == "cpu" else "mlx")
    if name not in names:
        raise ValueError(f"{env}={name!r}: choose one of {', '.join(names)}")
    return name
