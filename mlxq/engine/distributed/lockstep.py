"""Every rank runs the same engine steps: rank 0 replicates the calls that change engine
state, the other ranks apply them to identical engines.

The slot engine's decisions (joins, prefill groups, row order, prefix cache, cache
layout) are functions of the calls it gets and its step count, never of the clock or of
memory readings; so engines that get the same calls in the same order take the same
decisions and run the same collectives (tensor parallel: two ``all_sum`` per layer).
Rank 0's :class:`LockstepEngine` queues each ``add``, ``cancel`` and
``set_prefill_batch`` (run at once on rank 0) and sends the queue with the next ``step``,
``warmup`` or ``close``: one broadcast per step. Other ranks run :func:`follow`.

Sampling draws the same random keys on every rank: the ranks seed MLX's global random
state alike at start, and rank 0 gives every sampled job without a ``seed`` one before
it is sent. Messages are msgpack (msgspec), never pickle.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec

from mlxq.engine.distributed.channel import Channel
from mlxq.engine.protocol import BatchEngine
from mlxq.engine.sampling import Completion, EngineJob, StreamChunk
from mlxq.engine.stats import EngineStats
from mlxq.wire import Request

log = logging.getLogger("mlxq.engine.distributed")

# An idle rank 0 sends an empty message this often, so a rank that died is noticed
# before the next job arrives (its collective fails at once).
PING_S = 2.0


class Add(msgspec.Struct, tag="add"):
    key: str
    request: Request
    tokens: list[int] | None


class Cancel(msgspec.Struct, tag="cancel"):
    key: str


class PrefillBatch(msgspec.Struct, tag="prefill_batch"):
    n: int


class StepCall(msgspec.Struct, tag="step"):
    """One engine step (the calls before it applied first)."""


class Warmup(msgspec.Struct, tag="warmup"):
    pass


class Close(msgspec.Struct, tag="close"):
    pass


Call = Add | Cancel | PrefillBatch | StepCall | Warmup | Close
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[Call])


def seeded(job: EngineJob) -> EngineJob:
    """The job with an explicit seed if it samples at a temperature without one."""
    request = job.request
    if request.temperature <= 0 or request.seed is not None:
        return job
    seed = random.getrandbits(31)  # (n samples use seed + i: stays under 2**32)
    return EngineJob(job.key, msgspec.structs.replace(request, seed=seed))


class LockstepEngine:
    """Rank 0's engine: the local engine, with its state changes sent to every rank."""

    def __init__(self, inner: BatchEngine, channel: Channel) -> None:
        self.inner, self.channel = inner, channel
        self.info = inner.info
        self.steps = 0
        self._calls: list[Call] = []
        self._sent_at = time.monotonic()
        self._lost = False  # a send failed: another rank is gone

    @property
    def prefill_batch(self) -> int:
        """The inner engine's prefill batch."""
        return self.inner.prefill_batch

    @property
    def active(self) -> int:
        """Jobs admitted and not finished."""
        return self.inner.active

    def __getattr__(self, name: str) -> Any:  # tokenizer, model, ... (read-only uses)
        return getattr(self.inner, name)

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids (pure: not sent)."""
        return self.inner.encode(request)

    def prefill_length(self, tokens: list[int]) -> int:
        """Tokens of this prompt the engine will likely prefill (pure: not sent)."""
        return self.inner.prefill_length(tokens)

    def take_stream(self) -> list[StreamChunk]:
        """New output of stream jobs (the other ranks drop theirs)."""
        return self.inner.take_stream()

    def stats(self) -> EngineStats:
        """Rank 0's counts."""
        return self.inner.stats()

    def set_prefill_batch(self, n: int) -> None:
        """Resize prefill batches on every rank from the next step on."""
        self._calls.append(PrefillBatch(n))
        self.inner.set_prefill_batch(n)

    def add(self, job: EngineJob, tokens: list[int] | None = None) -> Completion | None:
        """Admit a job on every rank (seeded first if it samples without a seed)."""
        job = seeded(job)
        self._calls.append(Add(job.key, job.request, None if tokens is None else list(tokens)))
        return self.inner.add(job, tokens)

    def cancel(self, key: str) -> Completion | None:
        """Remove a job on every rank."""
        self._calls.append(Cancel(key))
        return self.inner.cancel(key)

    def step(self) -> list[Completion]:
        """One step on every rank (the queued calls first)."""
        self._send(StepCall())
        self.steps += 1
        return self.inner.step()

    def warmup(self) -> None:
        """Warm every rank's engine up."""
        self._send(Warmup())
        self.inner.warmup()

    def idle(self) -> None:
        """Called by the MLX thread while no job runs: a ping now and then, which fails
        at once if another rank is gone."""
        if time.monotonic() - self._sent_at >= PING_S:
            self._send(None)

    def close(self) -> None:
        """Close every rank's engine (the other ranks then exit); a lost rank is logged.
        After a failed send nothing more is sent: a collective with a lost peer can hang."""
        if not self._lost:
            try:
                self._send(Close())
            except RuntimeError as e:
                log.warning("could not tell the other ranks to close: %s", e)
        self.inner.close()

    def _send(self, last: Call | None) -> None:
        calls, self._calls = self._calls, []
        if last is not None:
            calls.append(last)
        try:
            self.channel.broadcast(_ENCODER.encode(calls))
        except RuntimeError:
            self._lost = True
            raise
        self._sent_at = time.monotonic()


def follow(
    engine: BatchEngine,
    channel: Channel,
    tick: Callable[[], None] | None = None,
) -> int:
    """Apply rank 0's calls to this rank's engine until rank 0 closes it; the steps run.

    Outputs are dropped (rank 0 has the same). A call that raises here raised on rank 0
    too (the same state): it is logged and the next one applied. Raises ``RuntimeError``
    when rank 0 (or another rank) is gone. A rank 0 that hangs fails no collective (in
    the wait for its next message, or inside a step's): ``tick()`` is called before each
    wait, for a watchdog of the time between them
    (:class:`~mlxq.engine.distributed.silence.Silence`).
    """
    steps = 0
    while True:
        if tick is not None:
            tick()
        calls = _DECODER.decode(channel.broadcast())
        if not apply_calls(calls, lambda c: _apply(engine, c), engine.close):
            return steps
        steps += sum(isinstance(c, StepCall) for c in calls)


def apply_calls(
    calls: list[Any], apply: Callable[[Any], object], close: Callable[[], None]
) -> bool:
    """A follower applies rank 0's ``calls`` in order: False (after ``close()``) at a
    :class:`Close`. A call that raises ``ValueError`` here raised on rank 0 too (the same
    state): it is logged and the next one applied."""
    for call in calls:
        if isinstance(call, Close):
            close()
            return False
        try:
            apply(call)
        except ValueError as e:
            log.debug("call %s failed here as on rank 0: %s", type(call).__name__, e)
    return True


def _apply(engine: BatchEngine, call: Call) -> None:
    if isinstance(call, StepCall):
        engine.step()
        engine.take_stream()  # (held until taken otherwise)
    elif isinstance(call, Add):
        engine.add(EngineJob(call.key, call.request), call.tokens)
    elif isinstance(call, Cancel):
        engine.cancel(call.key)
    elif isinstance(call, PrefillBatch):
        engine.set_prefill_batch(call.n)
    elif isinstance(call, Warmup):
        engine.warmup()
