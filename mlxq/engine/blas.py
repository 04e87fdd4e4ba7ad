"""Faster matrix multiplies for MLX on Linux CPUs: preload OpenBLAS.

MLX's Linux CPU wheel links the reference BLAS (a few GFLOP/s); preloading OpenBLAS
(Debian/Ubuntu ``libopenblas0-pthread``) is about 40x faster. ``LD_PRELOAD`` only acts at
process start, so commands that run a model re-execute themselves once with it set.
:func:`shared_among` shares OpenBLAS's threads for a block (a prefill split over CPU
streams runs one multiply a stream at once, :mod:`mlxq.engine.slots.prefill_streams`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
# Set to 0 to keep the reference BLAS (e.g. to compare).
ENV_SWITCH = "MLXQ_OPENBLAS"


def find_openblas() -> str | None:
    """Path of an installed OpenBLAS shared library, if any."""
    return next((p for p in CANDIDATES if Path(p).exists()), None)


def preload_env(env: dict[str, str]) -> dict[str, str] | None:
    """``env`` with OpenBLAS added to LD_PRELOAD, or None when not applicable."""
    if not sys.platform.startswith("linux") or env.get(ENV_SWITCH) == "0":
        return None
    lib = find_openblas()
    preload = env.get("LD_PRELOAD", "")
    if lib is None or "openblas" in preload:
        return None
    new = dict(env)
    new["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    new[ENV_SWITCH] = "0"  # re-executed once, never in a loop
    return new


def reexec_with_openblas() -> None:
    """Replace this process with itself under OpenBLAS, when that helps; else return."""
    env = preload_env(dict(os.environ))
    if env is None:
        return
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


@functools.cache
def _openblas() -> Any:
    """The OpenBLAS loaded in this process (its thread calls), or None (another BLAS)."""
    try:
        lib = ctypes.CDLL(None)
        lib.openblas_set_num_threads.argtypes = [ctypes.c_int]
        lib.openblas_get_num_threads.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


@contextlib.contextmanager
def shared_among(parts: int) -> Iterator[None]:
    """Inside the block OpenBLAS runs each multiply on its threads divided by ``parts``
    (at least one), for that many multiplies at once; as before after it. Nothing where
    another BLAS is loaded. Only where no multiply runs when it starts and ends."""
    lib = _openblas()
    before = lib.openblas_get_num_threads() if lib is not None else 1
    each = max(1, before // parts)
    if lib is None or each == before:
        yield
        return
    lib.openblas_set_num_threads(each)
    try:
        yield
    finally:
        lib.openblas_set_num_threads(before)
