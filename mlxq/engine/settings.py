"""Numbers the engine reads from environment variables, checked as they are read.

A setting a user mistyped fails at start with the variable, what was given and what to
give instead, never with Python's bare ``int()`` message or a silently clamped value.
Plain Python (no MLX), so policy modules may use it.
"""

from __future__ import annotations

import os


def whole_number(name: str, default: int, least: int = 0, unit: str = "") -> int:
    """The whole number in ``name`` (``default`` where it is unset); raises ``ValueError``
    for anything else (an empty value too) or one below ``least``. ``unit`` names what is
    counted ("of streams") in that message."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"{name}={raw!r}: give a whole number{unit}, {least} or more")
    return value


def number(name: str, default: float, least: float = 0.0, unit: str = "") -> float:
    """The number in ``name`` (``default`` where it is unset); raises ``ValueError`` for
    anything else (an empty value too) or one below ``least``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= least:  # (NaN included)
        raise ValueError(f"{name}={raw!r}: give a number{unit}, {least:g} or more")
    return value
