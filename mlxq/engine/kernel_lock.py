"""One process at a time builds MLX's CPU kernels on a machine.

MLX 0.32 compiles a CPU kernel (``mx.compile``: mlx-lm's activations, mlxq's softmax) with
the machine's C++ compiler the first time any process evaluates it, into its temporary
directory (``mlx/<version>/cpu``), and loads it from there afterwards. It checks only that
the library's file exists: two processes building the same kernel at once (workers started
together on a fresh machine) can write over each other's source or load a half-written
library. The softmax's warm-up builds its kernels under :func:`building_kernels`, so the
next process finds them built. (Work that waits on other processes, such as a split
model's first step with its collectives, must not run under it: a rank holding the lock
would wait for a rank waiting for the lock.)
"""

from __future__ import annotations

import fcntl
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = "mlxq-kernels.lock"
_in_process = threading.RLock()  # (a file lock taken twice in one process would wait forever)
_held = 0


@contextmanager
def building_kernels() -> Iterator[None]:
    """Hold the machine's lock on MLX's kernel folder while the body runs (re-entrant)."""
    global _held
    with _in_process:
        if _held:
            _held += 1
            try:
                yield
            finally:
                _held -= 1
            return
        folder = Path(tempfile.gettempdir()) / "mlx"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / LOCK_NAME, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _held = 1
            try:
                yield
            finally:
                _held = 0
                fcntl.flock(lock, fcntl.LOCK_UN)
