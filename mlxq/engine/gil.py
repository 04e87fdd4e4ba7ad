"""How soon a thread that let go of the GIL gets it back: Python's switch interval.

The MLX thread lets go of the GIL inside every evaluation (the launch of a decode step is
most of a CUDA step's host time), and so do the constraints' helper (llguidance, numpy)
and the worker's Redis thread in their C calls. Whoever runs Python meanwhile keeps the
GIL until it blocks or until the switch interval asks it to let go: 5 ms by default, half
a decode step. Measured on this CPU, a numpy call that lets go of the GIL took 6.1 ms
instead of 0.3 ms next to a thread running Python at 5 ms; 1.0 ms at 0.5 ms.

Plain Python (no MLX).
"""

from __future__ import annotations

import logging
import sys

from mlxq.engine.settings import number

log = logging.getLogger("mlxq.engine.gil")

ENV = "MLXQ_SWITCH_INTERVAL_MS"
DEFAULT_MS = 0.5


def shorten_switch_interval() -> float:
    """Lower Python's switch interval to ``MLXQ_SWITCH_INTERVAL_MS`` (default 0.5 ms), never
    raise it (``0`` leaves it alone); return the interval in force, in seconds."""
    ms = number(ENV, DEFAULT_MS, 0, " of milliseconds (0 leaves it alone)")
    current = sys.getswitchinterval()
    if ms and ms / 1000 < current:
        sys.setswitchinterval(ms / 1000)
        log.debug("switch interval %.2f ms (was %.2f ms)", ms, current * 1000)
    return sys.getswitchinterval()
