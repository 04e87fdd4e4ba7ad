"""Faster matrix multiplies for MLX on Linux CPUs: preload OpenBLAS.

MLX's Linux CPU wheel links the reference BLAS (a few GFLOP/s); preloading OpenBLAS
(Debian/Ubuntu ``libopenblas0-pthread``) is about 40x faster. ``LD_PRELOAD`` only acts at
process start, so commands that run a model re-execute themselves once with it set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
