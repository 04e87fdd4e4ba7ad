"""Errors a command reports as one line (``mlxq: error: ...``) instead of a traceback.

Anything that stops a command from starting (a model that cannot load, a missing extra,
a port in use, an engine that cannot start) raises a :class:`StartupError` whose message
names what failed, why, and the fix. The CLI's entry point prints it on one line and exits
non-zero; ``--log-level debug`` adds the traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class StartupError(Exception):
    """A command cannot start; the message says what failed, why, and how to fix it."""

    exit_code = 1


class MissingExtra(StartupError, ImportError):
    """An optional feature whose extra is not installed."""


@contextlib.contextmanager
def needs_extra(extra: str, feature: str) -> Iterator[None]:
    """Turn a missing module inside the block into a one-line :class:`MissingExtra`.

    Used around the imports of an optional extra, so that using ``feature`` without it
    says how to install the extra (from the clone: mlxq is not on a package index) instead
    of a ``ModuleNotFoundError`` traceback.
    """
    try:
        yield
    except ModuleNotFoundError as e:
        raise MissingExtra(
            f"{feature} needs the `{extra}` extra (missing module {e.name!r}): "
            f"pip install -e '.[{extra}]' in your mlxq clone"
        ) from e


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and message with whitespace collapsed."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
