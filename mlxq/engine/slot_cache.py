"""The slot KV cache: per layer, preallocated ``[slots, kv_heads, capacity, head_dim]``.

Each running job owns one slot (a row) from a free list, lowest first, so live rows stay
packed at the front. ``lengths[slot]`` counts the tokens in its cache. Freeing a slot is
bookkeeping only: no tensor work, no device sync; the next owner overwrites it.

- **Prefill** writes a joining group's keys and values into its slots at once
  (:meth:`SlotCache.write`), one slice update per layer when the slots are adjacent (the
  free list hands out the lowest first), else one scatter (about 100 GB/s on an H200).
- **Decode** writes one position per row (:class:`SlotLayer.update_and_fetch`, a scatter
  at each row's own length) and attends over each *group* of rows up to that group's
  longest row (:class:`DecodeState`), so short rows do not pay for the batch's longest.
- **Sorting** (:meth:`SlotCache.permute`) moves the live rows into a new slot order,
  when :mod:`mlxq.engine.slot_order` says it pays: one gather per layer.
- **Capacity** grows in steps (``step`` positions) when a row would outgrow it: one copy
  of the live rows per growth.

:class:`SlotLayer` is the cache object mlx-lm's model modules see during decode: they read
``offset`` (each row's position, an array: RoPE takes per-row offsets), call
``update_and_fetch`` and ``make_mask``; the attention call itself reaches
:meth:`SlotLayer.attend` through :mod:`mlxq.engine.mlx_lm_seam`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxq.engine.attention import Kernel
from mlxq.engine.slot_order import SPAN_ROUND, span_groups

# A layer's keys (or values): one array, or with ``bits`` the parts of ``mx.quantize``
# (packed ints, scales, biases), each ``[slots, kv_heads, capacity, *]``.
Stored = mx.array | tuple[mx.array, ...]


def _each(x: Stored, f: Callable[[mx.array], mx.array]) -> Stored:
    return tuple(f(p) for p in x) if isinstance(x, tuple) else f(x)


def _parts(x: Stored) -> tuple[mx.array, ...]:
    return x if isinstance(x, tuple) else (x,)


class SlotCache:
    """Keys and values of every layer for ``slots`` rows; allocated at the first write.

    With ``bits`` (8 or 4) they are stored quantized (``mx.quantize``, groups of
    ``group_size`` along the head dimension): 8 bits take about half of bfloat16's memory.
    """

    def __init__(
        self,
        num_layers: int,
        slots: int,
        step: int = 256,
        bits: int | None = None,
        group_size: int = 64,
    ) -> None:
        # Capacity in whole spans, so that no group's rounded span outgrows it.
        step = -(-step // SPAN_ROUND) * SPAN_ROUND
        self.num_layers, self.slots, self.step = num_layers, slots, step
        self.bits, self.group_size = bits, group_size
        self.keys: list[Stored] = []
        self.values: list[Stored] = []
        self.capacity = 0
        self.lengths = [0] * slots
        self._free = list(range(slots))  # a heap: the lowest free slot first

    @property
    def free_slots(self) -> int:
        """Slots no job holds."""
        return len(self._free)

    def alloc(self) -> int:
        """Take the lowest free slot (raises ``IndexError`` when none is free)."""
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back: bookkeeping only, its stale keys are overwritten by the next job."""
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    @property
    def nbytes(self) -> int:
        """Bytes the preallocated arrays hold."""
        return sum(p.nbytes for x in self.keys + self.values for p in _parts(x))

    def reserve(self, tokens: int) -> None:
        """Grow every layer so that each slot holds at least ``tokens`` positions."""
        if tokens <= self.capacity or not self.keys:
            return
        grown = -(-tokens // self.step) * self.step
        for layer in range(self.num_layers):
            self.keys[layer] = _each(self.keys[layer], lambda a: _grow(a, grown))
            self.values[layer] = _each(self.values[layer], lambda a: _grow(a, grown))
        mx.eval(self.keys, self.values)
        self.capacity = grown

    def permute(self, order: list[int]) -> None:
        """Move slot ``order[i]`` to slot ``i`` (the live rows, packed at the front); every
        other slot becomes free. One gather per layer: a copy of the whole cache."""
        live = set(order)
        perm = order + [s for s in range(self.slots) if s not in live]
        idx = mx.array(perm)
        for layer in range(self.num_layers):
            self.keys[layer] = _each(self.keys[layer], lambda a: a[idx])
            self.values[layer] = _each(self.values[layer], lambda a: a[idx])
        self.lengths[:] = [self.lengths[s] if s in live else 0 for s in perm]
        self._free = list(range(len(order), self.slots))  # sorted: a valid heap

    def write(self, slots: list[int], layer: int, keys: mx.array, values: mx.array) -> None:
        """Write ``[len(slots), kv_heads, n, dim]`` keys and values at positions ``0..n-1``."""
        n = keys.shape[2]
        if not self.keys:
            self._allocate(keys, values, n)
        self.reserve(n)
        first = slots[0]
        if slots == list(range(first, first + len(slots))):  # the usual case: a slice
            rows: slice | mx.array = slice(first, first + len(slots))  # (scatters are slow)
        else:
            rows = mx.array(slots)
        self.put(self.keys[layer], (rows, slice(None), slice(0, n)), keys)
        self.put(self.values[layer], (rows, slice(None), slice(0, n)), values)

    def put(self, stored: Stored, at: tuple[Any, ...], new: mx.array) -> None:
        """Write ``new`` (full precision) into ``stored[at]``, quantized if the cache is."""
        if not isinstance(stored, tuple):
            stored[at] = new
            return
        coded = mx.quantize(new, group_size=self.group_size, bits=self.bits)
        for part, data in zip(stored, coded, strict=True):
            part[at] = data

    def _allocate(self, keys: mx.array, values: mx.array, n: int) -> None:
        self.capacity = -(-max(n, 1) // self.step) * self.step
        heads = keys.shape[1]
        # In place: a compiled decode forward holds these lists as its state.
        self.keys[:] = [self._zeros(heads, keys) for _ in range(self.num_layers)]
        self.values[:] = [self._zeros(heads, values) for _ in range(self.num_layers)]

    def _zeros(self, heads: int, like: mx.array) -> Stored:
        lead, dim = (self.slots, heads, self.capacity), like.shape[3]
        if self.bits is None:
            return mx.zeros((*lead, dim), like.dtype)
        packed = mx.zeros((*lead, dim * self.bits // 32), mx.uint32)
        scales = mx.zeros((*lead, dim // self.group_size), like.dtype)
        return packed, scales, mx.zeros_like(scales)


def _grow(a: mx.array, capacity: int) -> mx.array:
    pad = mx.zeros((*a.shape[:2], capacity - a.shape[2], a.shape[3]), a.dtype)
    return mx.concatenate([a, pad], axis=2)


@dataclass
class DecodeState:
    """What every layer of one decode step shares: rows, positions, groups and masks.

    Rows are slots ``0..rows-1``; ``positions[i]`` is where row ``i``'s new token goes
    (its length before the step; 0 for a free slot, which then attends its own
    position 0 and stays finite). ``groups`` are ``(start, end, span)`` runs of rows with
    their own attention span.
    """

    positions: mx.array
    groups: list[tuple[int, int, int]]
    masks: list[mx.array]
    kernel: Kernel
    write_at: tuple[mx.array, mx.array, mx.array] | None = None  # scatter indices, per step

    @classmethod
    def make(
        cls, lengths: list[int], group_rows: int, kernel: Kernel, min_saving: int = 0
    ) -> DecodeState:
        """The state for rows of these lengths, in groups of ``group_rows`` rows; adjacent
        groups merge unless keeping them apart saves ``min_saving`` row-positions."""
        groups = span_groups(lengths, group_rows, min_saving)
        masks = []
        for start, end, span in groups:
            valid = mx.array(lengths[start:end]) + 1
            masks.append((mx.arange(span)[None] < valid[:, None])[:, None, None, :])
        return cls(mx.array(lengths), groups, masks, kernel)


class SlotLayer:
    """One layer's view of the slot cache during a decode step (mlx-lm's cache interface)."""

    def __init__(self, cache: SlotCache, layer: int, state: DecodeState) -> None:
        self.cache, self.layer, self.state = cache, layer, state
        self.offset = state.positions  # RoPE takes an array of per-row offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write each row's new key and value at its own position; return the layer's arrays."""
        c, layer, state = self.cache, self.layer, self.state
        if state.write_at is None:  # the same for every layer: made once per step
            rows, heads = keys.shape[:2]
            state.write_at = (
                mx.arange(rows)[:, None],
                mx.arange(heads)[None, :],
                state.positions[:, None],
            )
        c.put(c.keys[layer], state.write_at, keys[:, :, 0, :])
        c.put(c.values[layer], state.write_at, values[:, :, 0, :])
        return c.keys[layer], c.values[layer]

    def make_mask(self, n: int, **_: object) -> None:
        """No mask object: :meth:`attend` masks each group by its rows' lengths."""
        return None

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """Attention of each row's query over its own positions, group by group."""
        keys, values = self.cache.keys[self.layer], self.cache.values[self.layer]
        kernel, outs = self.state.kernel, []
        for (start, end, span), mask in zip(self.state.groups, self.state.masks, strict=True):
            k = _each(keys, lambda a, s=start, e=end, n=span: a[s:e, :, :n])
            v = _each(values, lambda a, s=start, e=end, n=span: a[s:e, :, :n])
            outs.append(kernel(queries[start:end], k, v, scale, mask))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
