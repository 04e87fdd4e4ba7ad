"""One decode step over the slot cache: its rows, inputs, forward, processors, hooks, sampling.

No engine state here: :class:`Row` (a decoding job) and :class:`Step` (a launched
step) are what the :class:`~mlxq.engine.slots.decoder.Decoder` holds between calls.
:func:`run_forward` and :func:`sample_step` build and start a step (``mx.async_eval``)
without waiting for it; the engine does the previous step's bookkeeping (tokens to the
host, stop strings, finishes) while this one computes, so the device does not idle
meanwhile. Except on CUDA (where overlapping measured faster), the previous step must
have finished before the next one is built: a write into the cache while a computation
that reads it is still pending copies the whole array (measured on the CPU: 320 ms a
step instead of 17 for a 64-slot cache), so the engine waits for it first (a wait, not a
round trip: its tokens stay on the device and feed the next step). A row's input is its
last token: a joining row's last prompt token, or the token the previous step sampled.
Steps that need the tokens on the host first (per-row logits processors need the row's
context; batch hooks advance matchers) hand the hooks the previous step's tokens first
(a constraint hook then advances its matchers on a helper thread), launch the model's part
(:func:`run_forward`), and sample (:func:`sample_step`) after the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import greedy_sampler

from mlxq.engine.protocol import BatchLogitsHook
from mlxq.engine.sampling import RunningJob, Sampler, token_logprobs
from mlxq.engine.slots.attention import Kernel
from mlxq.engine.slots.cache import DecodeState, SlotCache, SlotLayer
from mlxq.engine.slots.compiled import CompiledForward
from mlxq.engine.slots.n_samples import Samples
from mlxq.wire import TokenLogprob

# Rows per attention group (each attends up to its own longest row).
GROUP_ROWS = 64
# A per-row logits processor (mlx-lm's): (the row's tokens so far, its logits) -> logits.
Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass(eq=False)
class Row:
    """A decoding job (or one sample of a job of several, ``samples``): its slot, sampler,
    processors and the token it feeds next."""

    run: RunningJob
    slot: int
    sampler: Sampler
    processors: list[Processor]
    next_input: int  # the host copy; the step in flight may hold a newer one on the device
    samples: Samples | None = None  # its job's samples, if it is one of several
    index: int = 0  # which sample of them

    # What each step reads of its request, one attribute away (a step reads every row's).

    @cached_property
    def max_tokens(self) -> int:
        """Its request's ``max_tokens``."""
        return self.run.job.request.max_tokens

    @cached_property
    def stream(self) -> bool:
        """Whether its request streams."""
        return self.run.job.request.stream

    @cached_property
    def plain(self) -> bool:
        """Whether a token of it is only appended: no stop strings to watch (their
        detokenizer), no logprobs to keep."""
        return self.run.detokenizer is None and self.run.logprobs is None

    @cached_property
    def limit(self) -> int:
        """Its cache length once its last token's step is launched: prefill leaves the
        prompt less its last token in the cache, and each step launched adds one."""
        return len(self.run.prompt) - 1 + self.max_tokens


# Per-row reads of a whole step, in C (``map``) rather than a Python loop.
_slot_of = attrgetter("slot")
_processors_of = attrgetter("processors")
_key_of = attrgetter("run.job.key")
_sampler_of = attrgetter("sampler")


def _asks_logprobs(row: Row) -> bool:
    return row.run.logprobs is not None


@dataclass
class Step:
    """A launched decode step: its rows (slot order), sampled tokens and logprobs."""

    rows: list[Row]
    sampled: mx.array  # [rows]
    logprobs: mx.array  # [rows, vocab]; the raw logits where no row asked for them (greedy)
    _position: dict[int, int] | None = field(default=None, repr=False, compare=False)

    def position(self) -> dict[int, int]:
        """Row index in this step by row identity (``id``). Not by slot: a sort between
        steps moves live rows into the slots of rows that finished meanwhile, which this
        step still holds with their old slot numbers."""
        if self._position is None:
            self._position = {id(r): i for i, r in enumerate(self.rows)}
        return self._position

    def picked_logprobs(
        self, tokens: list[int], live: list[tuple[int, Row]], eos: set[int]
    ) -> dict[int, TokenLogprob]:
        """Logprobs of the sampled ``tokens`` for the ``live`` rows (index, row) that asked
        for them, EOS excepted, by row index."""
        wanted = [
            (i, n)
            for i, r in live
            if (n := r.run.job.request.logprobs) is not None and tokens[i] not in eos
        ]
        if not wanted:
            return {}
        picked = token_logprobs(
            self.logprobs[mx.array([i for i, _ in wanted])],
            [tokens[i] for i, _ in wanted],
            [n for _, n in wanted],
        )
        return {i: lp for (i, _), lp in zip(wanted, picked, strict=True)}


def run_forward(
    model: nn.Module,
    cache: SlotCache,
    kernel: Kernel,
    rows: list[Row],
    prev: Step | None,
    saving: int = 0,
    forward: CompiledForward | None = None,
    streams: list[mx.Stream] | None = None,
) -> mx.array:
    """The model's part of a decode step of ``rows`` (slot order): their logits, lazily.

    Inputs of rows in ``prev`` come from its sampled tokens on the device; ``saving``: see
    :class:`~mlxq.engine.slots.choices.DecodeChoices`; with ``forward`` the model runs
    compiled over every row of the cache; with ``streams`` the attention groups share out
    among those CPU streams. Advances each row's cache length by one.
    """
    width = cache.rows if forward is not None else rows[-1].slot + 1
    lengths, inputs = step_inputs(cache, rows, prev, width)
    if forward is not None:
        logits = forward(inputs, mx.array(lengths))
    else:
        state = DecodeState.make(lengths, GROUP_ROWS, kernel, saving, streams)
        layers = [SlotLayer(cache, i, state) for i in range(cache.num_layers)]
        logits = model(inputs[:, None], cache=layers)[:, -1, :]
    slots = list(map(_slot_of, rows))
    held = cache.lengths
    for slot in slots:
        held[slot] += 1  # the input token is now in its cache
    if len(rows) < width:
        logits = logits[mx.array(slots)]
    return logits


def step_inputs(
    cache: SlotCache, rows: list[Row], prev: Step | None, width: int
) -> tuple[list[int], mx.array]:
    """Each of slots ``0..width-1``'s length and input token for a step of ``rows`` (slot
    order); reserves the cache room the step writes. A row carried over from ``prev``
    (found by identity, whatever slot it holds now) takes its token there, on the device;
    any other row its host ``next_input``."""
    if prev is not None and len(rows) == width and prev.rows == rows:
        # The usual step: the same rows as the last one, filling slots 0..width-1 (rows
        # are in slot order), so its sampled tokens are the inputs as they are.
        lengths = [cache.lengths[r.slot] for r in rows]
        cache.reserve(max(lengths) + 1)
        return lengths, prev.sampled
    return _gathered_inputs(cache, rows, prev, width)


def _gathered_inputs(
    cache: SlotCache, rows: list[Row], prev: Step | None, width: int
) -> tuple[list[int], mx.array]:
    """Each slot's length and input token (a free slot's: 0 and 0). Token ids as
    ``uint32``, what sampling gives, so a compiled forward sees one input type.

    One gather from ``prev``'s sampled tokens followed by the host tokens (a free slot
    takes host token 0), so the rows are walked once."""
    at = {} if prev is None else prev.position()
    base = 0 if prev is None else len(prev.rows)
    lengths, source, host = [0] * width, [base] * width, [0]
    for r in rows:
        slot = r.slot
        lengths[slot] = cache.lengths[slot]
        i = at.get(id(r))
        if i is None:
            source[slot] = base + len(host)
            host.append(r.next_input)
        else:
            source[slot] = i
    cache.reserve(max(lengths) + 1)
    tokens = mx.array(host, dtype=mx.uint32)
    if prev is not None:
        tokens = mx.concatenate([prev.sampled, tokens])
    return lengths, tokens[mx.array(source)]


def move_rows(rows: dict[int, Row], order: list[int]) -> dict[int, Row]:
    """The rows by their new slot after slot ``order[i]`` moved to slot ``i`` (as
    :meth:`~mlxq.engine.slots.cache.SlotCache.permute` moves their cache); each row's
    ``slot`` follows. A step in flight still finds them: it goes by identity."""
    moved = {}
    for slot, old in enumerate(order):
        row = rows[old]
        row.slot = slot
        moved[slot] = row
    return moved


def relayed_step(rows: list[Row], vocab: int, hooks: list[BatchLogitsHook]) -> Step:
    """A step of a pipeline stage that does not sample: its tokens come from the rank that
    does (:meth:`~mlxq.engine.slots.decoder.Decoder.deliver`); its logprobs are zeros
    (that rank writes the results). The stage's forward has started its send already.
    The hooks still see the step (a constraint's masks, filled on the host, can find a
    job's grammar failed: the same on every rank); their logits are never computed."""
    zeros = mx.broadcast_to(mx.array(0.0), (len(rows), vocab))  # (a view: no memory)
    keys = [r.run.job.key for r in rows]
    for hook in hooks:
        hook.process(zeros, keys)
    return Step(rows, None, zeros)  # type: ignore[arg-type]


def sample_step(rows: list[Row], logits: mx.array, hooks: list[BatchLogitsHook]) -> Step:
    """Sample ``rows`` from their ``logits`` (:func:`sample`) and start computing it."""
    sampled, logprobs = sample(rows, logits, hooks)
    mx.async_eval(sampled, logprobs)
    return Step(rows, sampled, logprobs)


def sample(
    rows: list[Row], logits: mx.array, hooks: list[BatchLogitsHook]
) -> tuple[mx.array, mx.array]:
    """Per-row processors (needs each row's tokens on the host), hooks, then sampling."""
    if any(map(_processors_of, rows)):
        parts = []
        for i, r in enumerate(rows):
            row = logits[i : i + 1]
            if r.processors:
                context = mx.array(r.run.prompt + r.run.tokens)
                for processor in r.processors:
                    row = processor(context, row)
            parts.append(row)
        logits = mx.concatenate(parts, axis=0)
    keys = list(map(_key_of, rows))
    for hook in hooks:
        logits = hook.process(logits, keys)
    samplers = list(map(_sampler_of, rows))
    if (
        logits.dtype == mx.float32
        and samplers.count(greedy_sampler) == len(samplers)
        and not any(map(_asks_logprobs, rows))
    ):
        # Greedy, and no row reads its logprobs: at float32 the logits' argmax is their
        # logprobs' (mlx-lm's pick; the subtraction's rounding ties no two in practice)
        # and the logsumexp (an exp per vocabulary entry a row) was 8% of a CPU step. Not
        # at 16 bits: there the rounding ties near-equal logits, and argmax takes the first.
        return greedy_sampler(logits), logits
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if samplers.count(samplers[0]) == len(samplers):  # (one shared sampler: greedy)
        return samplers[0](logprobs), logprobs
    return mx.concatenate([s(logprobs[i : i + 1]) for i, s in enumerate(samplers)]), logprobs
