"""Rank 0's messages and sampled tokens to the other ranks, point to point.

A pipeline's ranks work on different micro-batches at the same moment, so nothing may
line them up: a collective (the lockstep's broadcast) would make every rank wait for
the slowest. Rank 0 sends each step's message with ``send`` on a stream of its own (a
step's compute never delays it) to every other rank, which receives it on its own
stream. One fixed :data:`FRAME` carries the lengths, the micro-batch and the start of
the message; then come the tokens (``uint32``; they may still be computing: the send
waits for them on that stream, not rank 0's Python), then the rest of a long message.

MLX's ring reaches only a rank's two neighbours, so rank 0 reaches every rank of a
ring of 2 or 3; a longer pipeline would have to forward (not done: refused at start).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxq.engine.distributed.channel import Traffic

FRAME = 256
_HEAD = 12  # message length (4), tokens (4), micro-batch (1), 3 spare
NO_STEP = 255  # the micro-batch of a message that runs no step (a ping, a close)
MAX_RANKS = 3


class Relay:
    """Point-to-point messages from rank 0 over ``group`` (module docstring)."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.stream = mx.new_stream(mx.cpu)
        self.traffic = Traffic()
        self.token_bytes = 0

    def send(self, turn: int, data: bytes, tokens: mx.array | None, wait: bool = False) -> None:
        """Rank 0: ``data`` and ``tokens`` (or none) for micro-batch ``turn`` to every rank;
        ``wait``: until sent (a failure raises here), else started."""
        n = 0 if tokens is None else tokens.size
        head = bytearray(FRAME)
        head[0:4] = len(data).to_bytes(4, "little")
        head[4:8] = n.to_bytes(4, "little")
        head[8] = turn
        first = data[: FRAME - _HEAD]
        head[_HEAD : _HEAD + len(first)] = first
        parts = [_array(bytes(head))]
        if tokens is not None and n:
            parts.append(tokens.astype(mx.uint32))
        if len(data) > len(first):
            parts.append(_array(data[len(first) :]))
        sent = []
        for dst in range(1, self.size):
            last = None
            for part in parts:  # (in this order on the wire: each send after the last)
                if last is not None:
                    part = mx.depends([part], [last])[0]
                last = mx.distributed.send(part, dst, group=self.group, stream=self.stream)
                sent.append(last)
        (mx.eval if wait else mx.async_eval)(sent)
        self.traffic.collectives += len(sent)
        self.traffic.payload_bytes += len(data) * (self.size - 1)
        self.traffic.array_bytes += (FRAME + 4 * n + len(data) - len(first)) * (self.size - 1)
        self.token_bytes += 4 * n * (self.size - 1)

    def receive(self) -> tuple[int, bytes, list[int]]:
        """Another rank: rank 0's next micro-batch, message and tokens (waits for them)."""
        head = bytes(memoryview(self._recv(FRAME, mx.uint8)))
        length = int.from_bytes(head[0:4], "little")
        n = int.from_bytes(head[4:8], "little")
        data = head[_HEAD : _HEAD + min(length, FRAME - _HEAD)]
        tokens: list[int] = self._recv(n, mx.uint32).tolist() if n else []  # type: ignore[assignment]
        if length > len(data):
            data += bytes(memoryview(self._recv(length - len(data), mx.uint8)))
        return head[8], data, tokens

    def _recv(self, n: int, dtype: mx.Dtype) -> mx.array:
        out = mx.distributed.recv((n,), dtype, 0, group=self.group, stream=self.stream)
        mx.eval(out)
        return out


def _array(data: bytes) -> mx.array:
    return mx.array(np.frombuffer(data, dtype=np.uint8))
