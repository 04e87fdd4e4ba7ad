"""Pipeline parallel with micro-batches in flight: every rank computes while the others do.

Each rank holds one stage of the model (:mod:`~mlxq.engine.distributed.stages`: rank 1
the first layers, rank 0 the last and the LM head) and one slot engine per micro-batch,
as many as there are ranks. The engines take turns: turn ``s`` steps micro-batch
``s mod M`` on every rank. Rank 1 computes micro-batch A's step and sends it on, then
starts B's while rank 0 finishes A's and samples it; by A's next turn A's tokens are
back. mlx-lm's own pipeline runs one batch through the ranks one after another (all but
one idle). With as many micro-batches as ranks, every rank is busy once the pipeline is
full.

As in the lockstep (:mod:`~mlxq.engine.distributed.lockstep`), every rank's engines get
the same calls in the same order and so take the same decisions; here rank 0 sends
them point to point (:class:`~mlxq.engine.distributed.relay.Relay`), never through a
collective, which would line the ranks up. Rank 0 samples; each turn's message carries
the tokens of that micro-batch's step in flight, which the other ranks' engines take
instead of sampling (:meth:`~mlxq.engine.slots.engine.SlotEngine.deliver`). Jobs go to
the micro-batch with the fewest rows. Messages are msgpack, never pickle.

Rank 0 sends its turns ahead (:class:`PipelineEngine`): MLX's ``async_eval`` blocks
once about a hundred operations wait behind one (here, the ``recv`` of a stage's input),
so rank 0's own step of a turn returns only when the stage before has sent it; a turn
sent only then would leave the other ranks idle meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from mlxq.engine.distributed.lockstep import (
    PING_S,
    Cancel,
    Close,
    PrefillBatch,
    apply_calls,
    seeded,
)
from mlxq.engine.distributed.relay import NO_STEP, Relay
from mlxq.engine.protocol import warm_up
from mlxq.engine.sampling import Completion, EngineJob, StreamChunk
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.stats import EngineStats
from mlxq.wire import Request

log = logging.getLogger("mlxq.engine.distributed")


class Join(msgspec.Struct, tag="join"):
    batch: int  # the micro-batch
    key: str
    request: Request
    tokens: list[int] | None


Call = Join | Cancel | PrefillBatch | Close
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[Call])


@dataclass
class _Turn:
    """A turn sent to the other ranks and not yet run here."""

    batch: int  # the micro-batch that steps, or NO_STEP
    calls: list[Call]


class PipelineEngine:
    """Rank 0's engine: its micro-batches' engines, each turn sent to every rank first.

    Rank 0 sends turns ahead, as many as there are ranks: while its own step of turn
    ``t`` waits for the stage before it, the other ranks already have turns up to
    ``t + M - 1`` to compute. So calls (``add``, ``cancel``, ``set_prefill_batch``) are
    queued, sent with the next turn, and applied here when that turn runs, as on every
    other rank: their completions (a job that cannot run, a cancel) come out of
    :meth:`step`.
    """

    def __init__(self, engines: list[SlotEngine], relay: Relay) -> None:
        self.engines, self.relay = engines, relay
        self.info = engines[0].info
        self.steps = 0  # turns run here
        self._turns = 0  # turns sent
        self._calls: list[Call] = []  # not sent yet
        self._ahead: deque[_Turn] = deque()
        self._sent: list[weakref.ref[Any] | None] = [None] * len(engines)
        self._sent_at = time.monotonic()
        self._lost = False  # a send failed: another rank is gone
        self._prefill_batch = engines[0].prefill_batch

    @property
    def prefill_batch(self) -> int:
        """The micro-batches' prefill batch (the last one set, though not yet applied)."""
        return self._prefill_batch

    @property
    def active(self) -> int:
        """Rows of jobs admitted and not finished, over the micro-batches, and one per
        call not yet applied here (so that the runner steps until they are)."""
        return sum(e.active for e in self.engines) + sum(_rows(c) for c in self._unapplied())

    def __getattr__(self, name: str) -> Any:  # tokenizer, model, ... (read-only uses)
        return getattr(self.engines[0], name)

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids (pure: not sent)."""
        return self.engines[0].encode(request)

    def prefill_length(self, tokens: list[int]) -> int:
        """Tokens of this prompt the engine will likely prefill (pure: not sent)."""
        return self.engines[0].prefill_length(tokens)

    def take_stream(self) -> list[StreamChunk]:
        """New output of stream jobs, from every micro-batch."""
        return [c for e in self.engines for c in e.take_stream()]

    def stats(self) -> EngineStats:
        """Rank 0's counts, summed over its micro-batches."""
        return sum_stats([e.stats() for e in self.engines])

    def set_prefill_batch(self, n: int) -> None:
        """Resize prefill batches on every rank (from the turn that carries it)."""
        self._calls.append(PrefillBatch(n))
        self._prefill_batch = max(1, min(n, self.engines[0].max_batch))

    def add(self, job: EngineJob, tokens: list[int] | None = None) -> Completion | None:
        """Queue a job for every rank (it joins a micro-batch when its turn is sent); a
        job that cannot run comes out of :meth:`step`. Raises ``ValueError`` if a job
        with the same key is already in the engine (as the slot engine does)."""
        if any(e.holds(job.key) for e in self.engines) or any(
            isinstance(c, Join) and c.key == job.key for c in self._unapplied()
        ):
            raise ValueError(f"job {job.key} is already in the engine")
        rows, parts = self.engines[0].max_batch, len(self.engines)
        if (n := job.request.n) > rows:  # (a job's samples share one micro-batch)
            now = time.time()
            why = (
                f"n = {n} samples take {n} rows of one micro-batch, and this pipeline's "
                f"{parts} micro-batches hold {rows} each; lower n or run the worker with "
                f"--max-batch {n * parts}"
            )
            return Completion(job.key, "error", error=why, admitted_at=now, finished_at=now)
        job = seeded(job)
        self._calls.append(Join(-1, job.key, job.request, tokens and list(tokens)))
        return None

    def cancel(self, key: str) -> Completion | None:
        """Queue a cancel for every rank; its completion comes out of :meth:`step`."""
        self._calls.append(Cancel(key))
        return None

    def step(self) -> list[Completion]:
        """Send turns ahead (module docstring), then run the oldest here."""
        while len(self._ahead) < len(self.engines):
            self._send_turn()
        turn = self._ahead.popleft()
        done = [c for call in turn.calls if (c := _apply(self.engines, call)) is not None]
        self.steps += 1
        return done + self.engines[turn.batch].step()

    def warmup(self) -> None:
        """One tiny generation through every rank."""
        warm_up(self)

    def idle(self) -> None:
        """While no job runs: a ping now and then, which fails at once if a rank is gone."""
        if time.monotonic() - self._sent_at >= PING_S:
            self._send(NO_STEP, [], None, wait=True)

    def close(self) -> None:
        """Close every rank's engines (the other ranks then exit); a lost rank is logged."""
        if not self._lost:
            try:
                self._send(NO_STEP, [Close()], None, wait=True)
            except RuntimeError as e:
                log.warning("could not tell the other ranks to close: %s", e)
        _close(self.engines)

    def _unapplied(self) -> list[Call]:
        """Calls not yet applied here: queued, or sent with a turn still ahead."""
        return [*self._calls, *(c for t in self._ahead for c in t.calls)]

    def _send_turn(self) -> None:
        """The next turn: the calls queued so far (each job placed in the micro-batch
        with the fewest rows) and the tokens of its micro-batch's step in flight."""
        batch, tokens = self._turns % len(self.engines), None
        inflight = self.engines[batch].in_flight()
        sent = self._sent[batch]
        if inflight is not None and (sent is None or sent() is not inflight):
            tokens, self._sent[batch] = inflight.sampled, weakref.ref(inflight)
        calls, self._calls = self._place(self._calls), []
        self._send(batch, calls, tokens)
        self._ahead.append(_Turn(batch, calls))
        self._turns += 1

    def _place(self, calls: list[Call]) -> list[Call]:
        rows = [e.active for e in self.engines]
        for turn in self._ahead:
            for c in turn.calls:
                if isinstance(c, Join):
                    rows[c.batch] += c.request.n
        out: list[Call] = []
        for c in calls:
            if isinstance(c, Join):
                c = msgspec.structs.replace(c, batch=rows.index(min(rows)))
                rows[c.batch] += c.request.n
            out.append(c)
        return out

    def _send(self, batch: int, calls: list[Call], tokens: Any, wait: bool = False) -> None:
        try:
            self.relay.send(batch, _ENCODER.encode(calls), tokens, wait)
        except RuntimeError:
            self._lost = True
            raise
        self._sent_at = time.monotonic()


def follow(engines: list[SlotEngine], relay: Relay, tick: Callable[[], None] | None = None) -> int:
    """Apply rank 0's turns to this rank's micro-batch engines until rank 0 closes them;
    the steps run. As :func:`~mlxq.engine.distributed.lockstep.follow`: outputs are
    dropped, a call that fails failed on rank 0 too, ``tick()`` before each wait."""
    steps = 0
    while True:
        if tick is not None:
            tick()
        turn, data, tokens = relay.receive()
        calls = _DECODER.decode(data)
        if not apply_calls(calls, lambda c: _apply(engines, c), lambda: _close(engines)):
            return steps
        if turn == NO_STEP:
            continue
        engine = engines[turn]
        if tokens:
            engine.deliver(tokens)
        engine.step()
        engine.take_stream()  # (held until taken otherwise)
        steps += 1


def _close(engines: list[SlotEngine]) -> None:
    for e in engines:
        e.close()


def _apply(engines: list[SlotEngine], call: Call) -> Completion | None:
    """Apply a call to a rank's micro-batch engines; its completion, if any."""
    if isinstance(call, Join):
        return engines[call.batch].add(EngineJob(call.key, call.request), call.tokens)
    if isinstance(call, Cancel):
        return cancel_in(engines, call.key)
    if isinstance(call, PrefillBatch):
        for e in engines:
            e.set_prefill_batch(call.n)
    return None


def _rows(call: Call) -> int:
    """What a call not yet applied counts in :attr:`PipelineEngine.active`."""
    return call.request.n if isinstance(call, Join) else 1


def cancel_in(engines: list[SlotEngine], key: str) -> Completion | None:
    """Cancel ``key`` in whichever engine holds it."""
    done = [c for e in engines if (c := e.cancel(key)) is not None]
    return done[0] if done else None


def sum_stats(parts: list[EngineStats]) -> EngineStats:
    """The counts of several engines, added up."""
    total = EngineStats()
    for f in dataclasses.fields(EngineStats):
        setattr(total, f.name, sum(getattr(p, f.name) for p in parts))
    return total
