"""Numbers the engine reads from environment variables, checked as they are read.

A setting a user mistyped fails at start with the variable, what was given and what to
give instead, never with Python's bare ``int()`` message or a silently clamped value.
Plain Python (no MLX), so policy modules may use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def whole_number(name: str, default: int, least: int = 0, unit: str = "") -> int:
    """The whole number in ``name`` (``default`` where it is unset); raises ``ValueError``
    for anything else (an empty value too) or one below ``least``. ``unit`` names what is
    counted ("of streams") in that message."""
    return int(_read(name, default, least, int, f"a whole number{unit}"))


def number(name: str, default: float, least: float = 0.0, unit: str = "") -> float:
    """The number in ``name`` (``default`` where it is unset); raises ``ValueError`` for
    anything else (an empty value too) or one below ``least``."""
    return _read(name, default, least, float, f"a number{unit}")


def _read(
    name: str, default: float, least: float, parse: Callable[[str], float], what: str
) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = parse(raw)
    except ValueError:
        value = float("nan")
    if not value >= least:  # (NaN included)
        raise ValueError(f"{name}={raw!r}: give {what}, {least:g} or more")
    return value
