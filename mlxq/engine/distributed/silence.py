"""A watchdog for a rank following rank 0: a rank 0 that hangs (a frozen host, a stopped
process) fails no collective, so the other ranks would wait on it forever.

The rank ticks a small watcher process (a byte on a pipe) each time it is ready for rank
0's next message; no tick for longer than the patience (a wait, or a step's collectives,
that long) makes the watcher print one line and kill the rank. A thread of the rank could
not do it: MLX holds the GIL while a collective waits. The watcher exits when the rank
does (its pipe closes). Joining the group (``start.join``) is watched the same way, as one
wait with no tick.
"""

from __future__ import annotations

import os
import subprocess
import sys

# argv: patience (s), the line ("{s}": the seconds since the last tick), the pid. stdin:
# a byte per tick; end of file: the rank is gone.
_WATCH = """import os, select, signal, sys, time
patience, line, pid = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
fd, since = sys.stdin.fileno(), time.monotonic()
while True:
    left = max(0.0, patience - (time.monotonic() - since))
    if select.select([fd], [], [], left)[0]:
        if not os.read(fd, 4096):
            break
        since = time.monotonic()
    else:
        sys.stderr.write(line.replace("{s}", "%.0f" % (time.monotonic() - since)) + "\\n")
        sys.stderr.flush()
        os.kill(pid, signal.SIGKILL)
        break
"""


class Silence:
    """Kills this process, after printing ``line``, when ``patience`` s pass without a
    :meth:`tick`."""

    def __init__(self, patience: float, line: str) -> None:
        self._watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCH, str(patience), line, str(os.getpid())],
            stdin=subprocess.PIPE,
        )
        assert self._watcher.stdin is not None
        self._fd = self._watcher.stdin.fileno()

    def tick(self) -> None:
        """Ready for rank 0's next message: the patience starts again."""
        os.write(self._fd, b".")

    def close(self) -> None:
        """Stop watching (the watcher exits)."""
        assert self._watcher.stdin is not None
        self._watcher.stdin.close()
        self._watcher.wait()
