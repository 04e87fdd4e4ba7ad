"""Rank 0's bytes to every rank, over an ``mx.distributed`` group.

MLX's collectives move arrays, not messages: a broadcast is an ``all_sum`` of a uint8
array that rank 0 fills and every other rank leaves zero. One fixed :data:`FRAME`
carries the length and the start of the message, so a step's usual message (a few
bytes) costs one collective; a longer one (a job's prompt) costs a second, of its rest.
Ring all-reduce sends ``2 (N - 1) / N`` times an array's bytes out of every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

FRAME = 256  # bytes of the first all_sum of every broadcast (4 of them the length)
_HEAD = 4


@dataclass
class Traffic:
    """What a channel moved so far."""

    collectives: int = 0
    payload_bytes: int = 0  # message bytes rank 0 meant to send
    array_bytes: int = 0  # bytes of the arrays summed (frames included)


class Channel:
    """Broadcasts from rank 0 and gathers from every rank, over ``group``.

    Every rank must make the same calls in the same order (collectives pair up by order).
    """

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.traffic = Traffic()

    def broadcast(self, data: bytes = b"") -> bytes:
        """Rank 0's ``data`` on every rank (the others' argument is ignored)."""
        head = bytearray(FRAME)
        if self.rank == 0:
            head[:_HEAD] = len(data).to_bytes(_HEAD, "little")
            first = data[: FRAME - _HEAD]
            head[_HEAD : _HEAD + len(first)] = first
            self.traffic.payload_bytes += len(data)
        got = self._sum(bytes(head))
        n = int.from_bytes(got[:_HEAD], "little")
        body = got[_HEAD : _HEAD + min(n, FRAME - _HEAD)]
        if n > FRAME - _HEAD:
            rest = data[FRAME - _HEAD :] if self.rank == 0 else bytes(n - (FRAME - _HEAD))
            body += self._sum(rest)
        return body

    def gather(self, data: bytes, size: int = 1024) -> list[bytes]:
        """Every rank's ``data`` (at most ``size`` bytes), by rank, on every rank."""
        if len(data) > size - _HEAD:
            raise ValueError(f"gather: {len(data)} bytes do not fit a slot of {size}")
        slots = bytearray(size * self.size)
        at = self.rank * size
        slots[at : at + _HEAD] = len(data).to_bytes(_HEAD, "little")
        slots[at + _HEAD : at + _HEAD + len(data)] = data
        got = self._sum(bytes(slots))
        out = []
        for r in range(self.size):
            n = int.from_bytes(got[r * size : r * size + _HEAD], "little")
            out.append(got[r * size + _HEAD : r * size + _HEAD + n])
        return out

    def _sum(self, data: bytes) -> bytes:
        array = mx.array(np.frombuffer(data, dtype=np.uint8))
        out = mx.distributed.all_sum(array, group=self.group, stream=mx.cpu)
        mx.eval(out)
        self.traffic.collectives += 1
        self.traffic.array_bytes += len(data)
        return bytes(memoryview(out))


def ring_bytes(array_bytes: int, size: int) -> float:
    """Bytes each rank sends for an all_sum of ``array_bytes`` over a ring of ``size``."""
    return 2 * (size - 1) / size * array_bytes
