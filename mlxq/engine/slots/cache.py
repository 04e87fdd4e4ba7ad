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
  when :mod:`mlxq.engine.slots.order` says it pays: one gather per layer.
- **Size** follows the work: the arrays hold ``rows`` rows (allocated at the first write,
  up to ``slots``) of ``capacity`` positions, in steps of ``step`` (finer on the CPU);
  :meth:`SlotCache.resize` lays them out anew (rows packed at the front, as the engine
  asks: grown as jobs join, shrunk as they leave, to the positions the live rows need),
  one copy per layer; :meth:`SlotCache.release` drops them when idle; on the CPU what
  they free goes back to the OS (:func:`map_large_buffers`). The scheduler admits jobs
  against the same shape (:func:`~mlxq.engine.scheduler.slot_cache_bytes`), or more.

:class:`SlotLayer` is the cache object mlx-lm's model modules see during decode: they read
``offset`` (each row's position, an array: RoPE takes per-row offsets), call
``update_and_fetch`` and ``make_mask``; the attention call itself reaches
:meth:`SlotLayer.attend` through :mod:`mlxq.engine.models.mlx_lm_seam`.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import heapq
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlxq.engine.hardware import backend_name
from mlxq.engine.models.mlx_lm_seam import AttendingCache
from mlxq.engine.scheduler import CACHE_STEP, cache_positions
from mlxq.engine.slots.attention import Kernel
from mlxq.engine.slots.order import SPAN_ROUND, share_out, span_groups

# A layer's keys (or values): one array, or with ``bits`` the parts of ``mx.quantize``
# (packed ints, scales, biases), each ``[slots, kv_heads, capacity, *]``.
Stored = mx.array | tuple[mx.array, ...]
# Where a write lands in a layer's array: rows, heads, positions (slices or index arrays).
Index = tuple[slice | mx.array, ...]


def _each(x: Stored, f: Callable[[mx.array], mx.array]) -> Stored:
    return tuple(f(p) for p in x) if isinstance(x, tuple) else f(x)


def _parts(x: Stored) -> tuple[mx.array, ...]:
    return x if isinstance(x, tuple) else (x,)


# Positions a row grows by on the CPU (else CACHE_STEP). A step attends each group up to
# its longest row, never the padding, so the step trades memory for copies: on the CPU
# the padded cache was most of a worker's RSS, and a copy is small against a step
# (bench/RESULTS.md).
CPU_CACHE_STEP = 64
# glibc's mallopt parameter, and the size from which the CPU's buffers are mapped apart.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20


@functools.cache
def map_large_buffers() -> bool:
    """On the CPU (Linux, glibc), map buffers of :data:`MMAP_THRESHOLD` bytes and up apart,
    so a resize's old layers go back to the OS when freed: glibc otherwise raises its
    threshold to the largest buffer freed (up to 32 MiB) and keeps later ones in a heap
    the RSS holds. Once a process; True where it was set."""
    if not sys.platform.startswith("linux") or backend_name() != "cpu":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False


class LayoutRefused(ValueError):
    """A layout :meth:`SlotCache.resize` cannot make, refused before anything changed."""


class SlotCache:
    """Keys and values of every layer for up to ``slots`` rows; allocated at the first
    write, as many rows as written or asked for (:meth:`resize`).

    With ``bits`` (8 or 4) they are stored quantized (``mx.quantize``, groups of
    ``group_size`` along the head dimension): 8 bits take about half of bfloat16's memory.
    """

    def __init__(
        self,
        num_layers: int,
        slots: int,
        step: int | None = None,
        bits: int | None = None,
        group_size: int = 64,
        on_copy: Callable[[float], None] | None = None,
    ) -> None:
        map_large_buffers()
        if step is None:
            step = CPU_CACHE_STEP if backend_name() == "cpu" else CACHE_STEP
        # Capacity in whole spans, so that no group's rounded span outgrows it.
        step = -(-step // SPAN_ROUND) * SPAN_ROUND
        self.num_layers, self.slots, self.step = num_layers, slots, step
        self.bits, self.group_size = bits, group_size
        self.keys: list[Stored] = []
        self.values: list[Stored] = []
        self.capacity = 0
        self.lengths = [0] * slots
        self._free = list(range(slots))  # a heap: the lowest free slot first
        self._wanted = (0, 0)  # (rows, capacity) asked for before the arrays exist
        self.on_copy = on_copy  # told the seconds of each copy of the arrays (a new layout)

    @property
    def rows(self) -> int:
        """Rows the arrays hold (0 before the first write)."""
        return _parts(self.keys[0])[0].shape[0] if self.keys else 0

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

    def positions(self, tokens: int) -> int:
        """The capacity that holds ``tokens`` positions (whole steps)."""
        return cache_positions(tokens, self.step)

    def reserve(self, tokens: int) -> None:
        """Grow every layer so that each slot holds at least ``tokens`` positions."""
        if tokens > max(self.capacity, self._wanted[1]):
            self.resize(max(self.rows, self._wanted[0]), self.positions(tokens))

    def permute(self, order: list[int]) -> None:
        """Move slot ``order[i]`` to slot ``i`` (the live rows, packed at the front); every
        other slot becomes free. One gather per layer: a copy of the whole cache."""
        self.resize(self.rows, self.capacity, order)

    def resize(self, rows: int, capacity: int, order: list[int] | None = None) -> None:
        """Lay the arrays out as ``rows`` x ``capacity`` positions (kept where no longer
        than a live row needs); with ``order``, slot ``order[i]`` moves to slot ``i`` and
        every other slot becomes free, else every row stays where it is. Before the first
        write: the shape to allocate. Slots past the arrays' rows (taken by a joining
        group, not yet written) come last in ``order`` and start as zeros. One copy per
        layer, each evaluated before the next, so the old layer is freed as the new one
        is made (peak: one layer over the larger of the two). Raises
        :class:`LayoutRefused`, the cache as it was, if the layout cannot hold the rows."""
        moved = order if order is not None else range(min(rows, self.rows))
        kept = [s for s in moved if s < self.rows]
        dropped = range(rows, self.rows) if order is None else ()
        if (
            len(moved) > rows
            or rows > self.slots
            or kept != list(moved[: len(kept)])
            or not set(dropped) <= set(self._free)
        ):
            raise LayoutRefused(f"cannot lay {len(moved)} rows out in {rows} of {self.slots}")
        if not self.keys:
            self._wanted = (rows, capacity)
        else:
            self._copy(kept, rows, capacity)
        if order is not None:
            self.lengths[:] = [self.lengths[s] for s in order] + [0] * (self.slots - len(order))
            self._free = list(range(len(order), self.slots))  # sorted: a valid heap

    def _copy(self, kept: list[int], rows: int, capacity: int) -> None:
        """Lay the arrays out anew (see :meth:`resize`), layer by layer."""
        tic = time.perf_counter()
        idx, keep = mx.array(kept, mx.int32), min(self.capacity, capacity)

        def laid(a: mx.array) -> mx.array:
            return _laid(a, idx, keep, rows, capacity)

        for layer in range(self.num_layers):
            for stored in (self.keys, self.values):
                stored[layer] = _each(stored[layer], laid)
            mx.eval(self.keys[layer], self.values[layer])
        self.capacity = capacity
        if self.on_copy is not None:
            self.on_copy(time.perf_counter() - tic)

    def release(self) -> None:
        """Drop the arrays (no row is live): the next write allocates anew, as it needs."""
        assert self.free_slots == self.slots, "release with live rows"
        self.keys[:], self.values[:] = [], []  # (in place: a compiled forward's state)
        self.capacity, self._wanted = 0, (0, 0)

    def write(self, slots: list[int], layer: int, keys: mx.array, values: mx.array) -> None:
        """Write ``[len(slots), kv_heads, n, dim]`` keys and values at positions ``0..n-1``
        (rows added where a slot lies past them). The first write allocates the arrays
        (their shape and dtype are the keys'), even with ``n`` = 0, which writes nothing."""
        n, high = keys.shape[2], max(slots) + 1
        if not self.keys:
            self._allocate(keys, values, max(high, self._wanted[0]), max(n, self._wanted[1]))
        if high > self.rows:
            self.resize(high, self.capacity)
        if not n:
            return
        self.reserve(n)
        first = slots[0]
        if slots == list(range(first, first + len(slots))):  # the usual case: a slice
            rows: slice | mx.array = slice(first, first + len(slots))  # (scatters are slow)
        else:
            rows = mx.array(slots)
        self.put(self.keys[layer], (rows, slice(None), slice(0, n)), keys)
        self.put(self.values[layer], (rows, slice(None), slice(0, n)), values)

    def put(self, stored: Stored, at: Index, new: mx.array) -> None:
        """Write ``new`` (full precision) into ``stored[at]``, quantized if the cache is."""
        if not isinstance(stored, tuple):
            stored[at] = new
            return
        coded = mx.quantize(new, group_size=self.group_size, bits=self.bits)
        for part, data in zip(stored, coded, strict=True):
            part[at] = data

    def _allocate(self, keys: mx.array, values: mx.array, rows: int, n: int) -> None:
        self.capacity, self._wanted = self.positions(max(n, 1)), (0, 0)
        heads = keys.shape[1]
        # In place: a compiled decode forward holds these lists as its state.
        self.keys[:] = [self._zeros(rows, heads, keys) for _ in range(self.num_layers)]
        self.values[:] = [self._zeros(rows, heads, values) for _ in range(self.num_layers)]

    def _zeros(self, rows: int, heads: int, like: mx.array) -> Stored:
        lead, dim = (rows, heads, self.capacity), like.shape[3]
        if self.bits is None:
            return mx.zeros((*lead, dim), like.dtype)
        packed = mx.zeros((*lead, dim * self.bits // 32), mx.uint32)
        scales = mx.zeros((*lead, dim // self.group_size), like.dtype)
        return packed, scales, mx.zeros_like(scales)


def _laid(a: mx.array, idx: mx.array, keep: int, rows: int, capacity: int) -> mx.array:
    """Rows ``idx`` of ``a`` (their first ``keep`` positions) at the front of a
    ``rows`` x ``capacity`` array; a gather, so a new buffer even where nothing pads."""
    moved = a[idx, :, :keep] if idx.size else a[:0, :, :keep]
    pad = [(0, rows - moved.shape[0]), (0, 0), (0, capacity - keep), (0, 0)]
    return mx.pad(moved, pad) if rows > moved.shape[0] or capacity > keep else moved


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
    streams: list[mx.Stream] | None = None  # each group's CPU stream (None: the default)

    @classmethod
    def make(
        cls,
        lengths: list[int],
        group_rows: int,
        kernel: Kernel,
        min_saving: int = 0,
        streams: list[mx.Stream] | None = None,
    ) -> DecodeState:
        """The state for rows of these lengths, in groups of ``group_rows`` rows; adjacent
        groups merge unless keeping them apart saves ``min_saving`` row-positions. With
        several ``streams``, the groups are shared out among them
        (:func:`~mlxq.engine.slots.order.share_out`; each row attends as it would alone)."""
        groups = span_groups(lengths, group_rows, min_saving)
        on = None
        if streams is not None and len(streams) > 1:
            shared = share_out(groups, len(streams))
            groups, on = [g[:3] for g in shared], [streams[g[3]] for g in shared]
        masks = []
        for start, end, span in groups:
            valid = mx.array(lengths[start:end]) + 1
            masks.append((mx.arange(span)[None] < valid[:, None])[:, None, None, :])
        return cls(mx.array(lengths), groups, masks, kernel, streams=on)


class SlotLayer(AttendingCache):
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

    def attend(self, queries: mx.array, scale: float, mask: object = None) -> mx.array:
        """Attention of each row's query over its own positions, group by group (the
        model's ``mask``, None for one token a row, is not needed: the groups have theirs)."""
        keys, values = self.cache.keys[self.layer], self.cache.values[self.layer]
        state, outs = self.state, []
        on = state.streams or [None] * len(state.groups)
        for (start, end, span), valid, stream in zip(state.groups, state.masks, on, strict=True):
            k = _each(keys, lambda a, s=start, e=end, n=span: a[s:e, :, :n])
            v = _each(values, lambda a, s=start, e=end, n=span: a[s:e, :, :n])
            with mx.stream(stream) if stream is not None else contextlib.nullcontext():
                outs.append(state.kernel(queries[start:end], k, v, scale, valid))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
