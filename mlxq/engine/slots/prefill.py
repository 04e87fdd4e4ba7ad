"""Prefill of a joining group: its prompts as their own batch, written into their slots.

A group's prompts share one cached prefix (or none): that prefix is copied once into
each row of the group's temporary cache, with room after it. The rest of each prompt but
its last token is right-padded to the group's longest and run through the model in
chunks of ``step`` tokens with a plain causal mask (a pad only ever follows a row's real
tokens, so no real token sees one), and every row's keys and values are then written
into its slot. Each prompt's last token is fed by the row's first decode step, as in
mlx-lm. A pad's keys land past the row's length, where decode masks them and then
overwrites them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlxq.engine.slots.buckets import bucket_rows, bucket_tokens
from mlxq.engine.slots.cache import SlotCache
from mlxq.engine.slots.causal_blocks import prompt_cache
from mlxq.engine.slots.prefill_streams import PrefillStreams
from mlxq.engine.slots.softmax import Softmax, mlx_softmax


@dataclass
class PrefillRows:
    """The group's temporary caches after prefill: one row per joining job, in parts (one
    a stream) that start at row ``starts[k]``."""

    parts: list[list[KVCache]]
    starts: list[int]

    def row(self, i: int) -> list[KVCache]:
        """Row ``i``'s keys and values per layer (the prefix cache copies blocks out of it)."""
        k = max(k for k, start in enumerate(self.starts) if start <= i)
        at = i - self.starts[k]
        out = []
        for c in self.parts[k]:
            one = KVCache()
            one.keys, one.values, one.offset = c.keys[at : at + 1], c.values[at : at + 1], c.offset
            out.append(one)
        return out


def prefill_group(
    model: nn.Module,
    cache: SlotCache,
    slots: list[int],
    suffixes: list[list[int]],
    prefix: list[KVCache] | None,
    step: int,
    buckets: bool = False,
    copies: list[int] | None = None,
    streams: PrefillStreams | None = None,
    block: int = 0,
    softmax: Softmax = mlx_softmax,
) -> PrefillRows:
    """Prefill ``suffixes`` after the shared ``prefix`` and write the rows into ``slots``.

    ``suffixes`` are the prompts less the prefix and less their last token (possibly
    empty). With ``buckets`` the call's rows and length are padded to
    :mod:`~mlxq.engine.slots.buckets` sizes (dummy rows are never written). With
    ``copies``, prompt ``i`` is written into ``copies[i]`` consecutive slots (the samples
    of one job: one prefill, n rows). With ``streams``, the prompts are split over CPU
    streams (:mod:`~mlxq.engine.slots.prefill_streams`), each part written from its own
    temporary cache. With ``block``, each part attends in blocks of that many query rows
    (:mod:`~mlxq.engine.slots.causal_blocks`) composed with ``softmax``. Returns the
    temporary caches (real rows first); ``cache.lengths`` is set for each slot; the
    cache's arrays exist afterwards, even where nothing was written (every prompt one
    token long).
    """
    copies = copies or [1] * len(suffixes)
    rows = len(suffixes)
    longest = max(len(s) for s in suffixes)
    start = prefix[0].offset if prefix is not None else 0
    end = start + longest
    # Nothing to write (one-token prompts, no prefix: each starts at its first decode
    # step) into a cache whose arrays do not exist yet (an idle engine drops them): they
    # take their shape and dtype from the model's keys, so one pad position goes through
    # the model, its keys only a template (written nowhere), and the cache is allocated.
    template = not end and not cache.keys
    width, height = max(longest, int(template)), rows
    if buckets and longest:
        width, height = bucket_tokens(longest, step), bucket_rows(rows)
    padded = [s + [0] * (width - len(s)) for s in suffixes] + [[0] * width] * (height - rows)
    split = streams is not None and not buckets and longest > 0 and rows > 1
    parts = streams.parts(rows) if streams is not None and split else [(0, height)]
    temps = _forward(
        model, [padded[lo:hi] for lo, hi in parts], prefix, step, streams, (block, softmax)
    )
    if end or template:
        cache.reserve(end + 1)
        at = 0
        for (lo, hi), temp in zip(parts, temps, strict=True):
            real = min(hi, rows) - lo  # (not a bucket's dummy rows)
            # Each slot's source row: each row once, or repeated for its copies (a gather).
            source = [i - lo for i in range(lo, lo + real) for _ in range(copies[i])]
            picked = None if len(source) == real else mx.array(source)
            for layer, c in enumerate(temp):
                keys, values = c.keys[:real, :, :end, :], c.values[:real, :, :end, :]
                if picked is not None:
                    keys, values = keys[picked], values[picked]
                cache.write(slots[at : at + len(source)], layer, keys, values)
            at += len(source)
        mx.eval(cache.keys, cache.values)
    rows_of = [i for i, k in enumerate(copies) for _ in range(k)]
    for slot, i in zip(slots, rows_of, strict=True):
        cache.lengths[slot] = start + len(suffixes[i])
    return PrefillRows(temps, [lo for lo, _ in parts])


def _forward(
    model: nn.Module,
    parts: list[list[list[int]]],
    prefix: list[KVCache] | None,
    step: int,
    streams: PrefillStreams | None,
    blocks: tuple[int, Softmax],
) -> list[list[KVCache]]:
    """The model over each part's padded prompts (a stream each where there are several),
    in chunks of ``step``, after ``prefix``, attending in ``blocks`` (rows, softmax): a
    temporary cache a part."""
    width = len(parts[0][0])
    temps = [prompt_cache(model, *blocks) for _ in parts]
    for temp, part in zip(temps, parts, strict=True):
        if prefix is not None:
            for c, p in zip(temp, prefix, strict=True):
                c.keys = _rows_of(p.keys, len(part), width)
                c.values = _rows_of(p.values, len(part), width)
                c.offset = p.offset
    tokens = [mx.array(part) for part in parts] if width else []
    for at in range(0, width, step):
        for i, temp in enumerate(temps):
            with mx.stream(streams.streams[i]) if streams is not None else contextlib.nullcontext():
                model(tokens[i][:, at : at + step], cache=temp)
        arrays = [a for temp in temps for c in temp for a in (c.keys, c.values)]
        if streams is not None and len(parts) > 1:
            streams.evaluate(arrays, len(parts))
        else:
            mx.eval(arrays)
    return temps


def _rows_of(prefix: mx.array, rows: int, room: int) -> mx.array:
    """``rows`` copies of a ``[1, heads, n, dim]`` prefix, with ``room`` positions after
    it, so the model's cache writes the suffix in place instead of growing (a copy)."""
    _, heads, n, dim = prefix.shape
    out = mx.zeros((rows, heads, n + room, dim), prefix.dtype)
    out[:, :, :n, :] = prefix
    return out
