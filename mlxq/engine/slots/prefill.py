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

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxq.engine.slots.buckets import bucket_rows, bucket_tokens
from mlxq.engine.slots.cache import SlotCache


@dataclass
class PrefillRows:
    """The group's temporary cache after prefill: one row per joining job."""

    caches: list[KVCache]

    def row(self, i: int) -> list[KVCache]:
        """Row ``i``'s keys and values per layer (the prefix cache copies blocks out of it)."""
        out = []
        for c in self.caches:
            one = KVCache()
            one.keys, one.values, one.offset = c.keys[i : i + 1], c.values[i : i + 1], c.offset
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
) -> PrefillRows:
    """Prefill ``suffixes`` after the shared ``prefix`` and write the rows into ``slots``.

    ``suffixes`` are the prompts less the prefix and less their last token (possibly
    empty). With ``buckets`` the call's rows and length are padded to
    :mod:`~mlxq.engine.slots.buckets` sizes (dummy rows are never written). With
    ``copies``, prompt ``i`` is written into ``copies[i]`` consecutive slots (the samples
    of one job: one prefill, n rows). Returns the temporary cache (real rows first);
    ``cache.lengths`` is set for each slot; the cache's arrays exist afterwards, even
    where nothing was written (every prompt one token long).
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
    temp = make_prompt_cache(model)
    if prefix is not None:
        for c, p in zip(temp, prefix, strict=True):
            c.keys, c.values = _rows_of(p.keys, height, width), _rows_of(p.values, height, width)
            c.offset = p.offset
    if width:
        padded = [s + [0] * (width - len(s)) for s in suffixes]
        tokens = mx.array(padded + [[0] * width] * (height - rows))
        for at in range(0, width, step):
            model(tokens[:, at : at + step], cache=temp)
            mx.eval([a for c in temp for a in (c.keys, c.values)])
    # Each slot's source row: 0..rows-1, or each row repeated for its copies (a gather).
    source = [i for i, k in enumerate(copies) for _ in range(k)]
    picked = None if len(source) == rows else mx.array(source)
    if end or template:
        cache.reserve(end + 1)
        for layer, c in enumerate(temp):
            keys, values = c.keys[:rows, :, :end, :], c.values[:rows, :, :end, :]
            if picked is not None:
                keys, values = keys[picked], values[picked]
            cache.write(slots, layer, keys, values)
        mx.eval(cache.keys, cache.values)
    for slot, i in zip(slots, source, strict=True):
        cache.lengths[slot] = start + len(suffixes[i])
    return PrefillRows(temp)


def _rows_of(prefix: mx.array, rows: int, room: int) -> mx.array:
    """``rows`` copies of a ``[1, heads, n, dim]`` prefix, with ``room`` positions after
    it, so the model's cache writes the suffix in place instead of growing (a copy)."""
    _, heads, n, dim = prefix.shape
    out = mx.zeros((rows, heads, n + room, dim), prefix.dtype)
    out[:, :, :n, :] = prefix
    return out
