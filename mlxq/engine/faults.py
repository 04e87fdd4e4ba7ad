"""Whose fault an error is: a peer rank gone is the worker's, never the jobs'.

The slot engine fails the jobs an error hits, but a collective whose peer rank is gone
(one engine over several hosts, :mod:`mlxq.engine.distributed`) is raised instead, so the
worker puts the jobs back. Here, below both, so the slot engine needs nothing of
``distributed``.
"""

from __future__ import annotations

# How MLX's distributed backends word a collective whose peer is gone (a RuntimeError):
# their prefixes, and the socket errors of the ring (read from libmlx's strings).
_PEER_LOST = (
    "[ring]",
    "[jaccl]",
    "Send failed with errno",
    "Recv failed with errno",
    "was closed by the peer",
)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank is gone: the worker's
    fault, not the jobs' (they go back on their queues rather than fail)."""
    return isinstance(exc, RuntimeError) and any(p in str(exc) for p in _PEER_LOST)
