"""Child processes that die with mlxq: an embedded Valkey must never outlive the process
that started it (an OOM kill, a SIGKILL, a crash), or it keeps its port and its data folder.

On Linux the child asks the kernel for ``SIGTERM`` when its parent dies
(``PR_SET_PDEATHSIG``); Valkey takes it as a clean shutdown. Elsewhere a tiny watchdog
process holds a pipe from the parent: when the parent dies, however, the pipe closes and
the watchdog sends the child ``SIGTERM``. Either way the child runs in a session of its own,
so a Ctrl-C at the terminal reaches mlxq alone, which stops the child after its own clients.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# Reads one byte: the parent's "stopped it myself" (nothing to do), or EOF if it died.
_WATCHDOG = """
import os, signal, sys
if not sys.stdin.buffer.read(1):
    try:
        os.kill(int(sys.argv[1]), signal.SIGTERM)
    except ProcessLookupError:
        pass
"""


def _pdeathsig_setter() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks for ``SIGTERM`` at the parent's death, or None off Linux.

    The libc function is looked up here, in the parent: between fork and exec the child
    only makes the call (a lookup there could take a lock another thread held)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong]
    sig = int(signal.SIGTERM)
    return lambda: prctl(_PR_SET_PDEATHSIG, sig)


def popen_options() -> dict[str, Any]:
    """``subprocess.Popen`` options for a child that dies with this process (on Linux;
    elsewhere add :func:`watch` once it runs). The kernel signals the child when the
    *thread* that started it ends: start it from a thread that lives as long as it should
    (mlxq starts its servers on the main thread)."""
    options: dict[str, Any] = {"start_new_session": True}
    setter = _pdeathsig_setter()
    if setter is not None:
        options["preexec_fn"] = setter
    return options


class Watchdog:
    """A process that sends ``SIGTERM`` to ``pid`` if this process dies first."""

    def __init__(self, pid: int) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C must not end the watch early
        )

    def release(self) -> None:
        """The child was stopped by us: end the watch without signalling anything."""
        stdin = self._proc.stdin
        if stdin is None or stdin.closed:
            return
        try:
            stdin.write(b"x")
            stdin.close()
        except OSError:  # the watchdog is gone already: nothing is watched
            pass
        self._proc.wait(10)


def watch(pid: int, *, always: bool = False) -> Watchdog | None:
    """A :class:`Watchdog` for ``pid`` where the kernel does not guard it (off Linux), or
    with ``always``; None where :func:`popen_options` already did."""
    if always or _pdeathsig_setter() is None:
        return Watchdog(pid)
    return None
