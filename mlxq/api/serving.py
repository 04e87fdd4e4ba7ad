"""Serving an ASGI app with uvicorn, with idle and slow connections closed.

uvicorn closes a connection idle *between* requests (``timeout_keep_alive``), but one that
connects and sends nothing, or sends a request's head or body a byte at a time, is kept
forever: a few hundred of them exhaust a 256-descriptor limit (macOS's default) and the
server stops accepting. :func:`guarded_protocol` adds what uvicorn lacks:

- a request's head must arrive within ``read_timeout`` seconds of the connection (or of its
  first byte after the previous response), else the connection is closed;
- inside a body, ``read_timeout`` seconds without a byte close the connection;
- past ``max_connections`` open connections a new one is answered ``503`` and closed at
  once, so descriptors are left for Redis and the rest of the process;
- the listen backlog (which is also how many connections asyncio accepts in one go, before
  any of them is checked against the cap) fits in the descriptors the cap leaves, for as
  many accepts in a row as a refused connection lives through.
"""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass
from typing import Any

from mlxq.errors import needs_extra

DEFAULT_READ_TIMEOUT = 20.0
DEFAULT_KEEP_ALIVE = 5
# Larger than any request head mlxq's API takes (uvicorn's default, said explicitly).
MAX_HEAD_BYTES = 16 * 1024
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 34\r\n"
    b"connection: close\r\n\r\ntoo many connections; retry later\n"
)


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may be silent and how many connections may be open."""

    read_timeout: float = DEFAULT_READ_TIMEOUT
    keep_alive: int = DEFAULT_KEEP_ALIVE
    max_connections: int | None = None  # None: from the open-file limit

    def connections(self) -> int:
        """``max_connections``, or half the descriptors the process may open (after
        ``_RESERVED`` kept for Redis, logs and the rest), between 8 and 1,000."""
        if self.max_connections is not None:
            return self.max_connections
        return max(8, min(1000, (_open_files() - _RESERVED) // 2))

    def backlog(self) -> int:
        """The listen backlog: uvicorn's 2,048, or what the descriptors left by the
        connections and the reserve allow for ``_ACCEPT_TURNS`` accepts (at least 16)."""
        spare = _open_files() - self.connections() - _RESERVED
        return max(16, min(2048, spare // _ACCEPT_TURNS))


_RESERVED = 64  # descriptors kept for Redis connections, logs and the interpreter
# Event-loop turns a refused connection's socket stays open: asyncio accepts a backlog's
# worth in one turn, builds their transports in the next, the protocol answers 503 in the
# third and the socket closes in the fourth, while each turn accepts another backlog's worth.
# (With the whole spare as the backlog, a burst of 300 against 256 descriptors hit EMFILE.)
_ACCEPT_TURNS = 4
_UNLIMITED = 1 << 20


def _open_files() -> int:
    """How many descriptors this process may open."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _UNLIMITED if soft == resource.RLIM_INFINITY else soft


def guarded_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's h11 protocol with ``limits``' read timeout and connection cap."""
    with needs_extra("api", "mlxq api"):  # imported here: the CLI loads without the extra
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol
    cap = limits.connections()

    class Guarded(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _head_timer = False  # whether _timer is the head's deadline (not a body silence)

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > cap:
                transport.write(_BUSY)
                transport.close()
                return
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def _watch(self) -> None:
            """Arm the timer for what the client owes: a head (a deadline from its first
            byte) or the rest of a body (a silence, restarted by every byte)."""
            if self.transport.is_closing():
                return
            state = self.conn.their_state
            if state is h11.IDLE:
                if not (self._timer and self._head_timer):
                    self._start_timer(head=True)
            elif state is h11.SEND_BODY:
                self._start_timer(head=False)
            else:
                self._stop_timer()

        def _start_timer(self, head: bool) -> None:
            self._stop_timer()
            self._head_timer = head
            self._timer = self.loop.call_later(limits.read_timeout, self._timed_out)

        def _stop_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _timed_out(self) -> None:
            self._timer = None
            state = self.conn.their_state
            if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
                return
            if state is h11.SEND_BODY and self.flow.read_paused:
                self._start_timer(head=False)  # we stopped reading, not the client
            elif state is h11.SEND_BODY or self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return Guarded


def run(app: Any, host: str, port: int, limits: ConnectionLimits, log_level: str) -> None:
    """Serve ``app`` on ``host:port`` until stopped, with ``limits``."""
    with needs_extra("api", "mlxq api"):
        import uvicorn

    uvicorn.run(app, **server_options(limits), host=host, port=port, log_level=log_level)


def server_options(limits: ConnectionLimits) -> dict[str, Any]:
    """uvicorn settings that apply ``limits`` (for ``uvicorn.run`` or ``uvicorn.Config``)."""
    return {
        "http": guarded_protocol(limits),
        "timeout_keep_alive": limits.keep_alive,
        "backlog": limits.backlog(),
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }
