"""How the slot engine's rows are grouped for attention, when to sort them, and how the
groups share out among CPU streams: plain Python (no MLX).

A decode step attends each group of adjacent slots up to that group's longest row
(:func:`span_groups`), so rows of similar lengths in neighbouring slots read less. Slots
are handed out lowest free first and rows end at their own lengths, so after a while
long and short rows mix; :func:`sorted_order` says when moving the live rows into length
order (one copy of the cache) pays for itself. On the CPU, where MLX runs each stream on
a thread of its own and the attention's softmax on one thread a stream, the groups are
shared out among streams (:func:`share_out`), so both cores attend.
"""

from __future__ import annotations

# Attention spans are rounded up to this many positions (fewer distinct shapes).
SPAN_ROUND = 32
# Sort only when the sorted rows would read at most this share of what they read now: a
# sort copies the whole cache (about two steps' reads).
SORT_GAIN = 0.75


def _span(lengths: list[int]) -> int:
    return -(-(max(lengths) + 1) // SPAN_ROUND) * SPAN_ROUND


def span_groups(lengths: list[int], group_rows: int, min_saving: int) -> list[tuple[int, int, int]]:
    """``(start, end, span)`` runs of rows, each attending up to its own longest row.

    Rows come in runs of ``group_rows``; a run joins the one before it when attending both
    over the longer span costs fewer than ``min_saving`` extra row-positions: a group costs
    kernel launches and host work of its own, which only long spans repay.
    """
    groups: list[tuple[int, int, int]] = []
    for start in range(0, len(lengths), group_rows):
        end = min(start + group_rows, len(lengths))
        span = _span(lengths[start:end])
        if groups:
            s0, _, span0 = groups[-1]
            wide = max(span0, span)
            extra = (start - s0) * (wide - span0) + (end - start) * (wide - span)
            if extra < min_saving:
                groups[-1] = (s0, end, wide)
                continue
        groups.append((start, end, span))
    return groups


def share_out(groups: list[tuple[int, int, int]], streams: int) -> list[tuple[int, int, int, int]]:
    """``(start, end, span, stream)``: the attention groups shared out among ``streams``
    streams, each stream's row-positions about equal. While the widest group holds more
    than one stream's share, it is halved by rows (both halves keep its span, at most 4
    parts a stream); then each part, widest first, goes to the stream with the least."""
    parts = list(groups)
    total = sum((end - start) * span for start, end, span in parts)
    while len(parts) < 4 * streams:
        start, end, span = max(parts, key=lambda g: (g[1] - g[0]) * g[2])
        if end - start < 2 or (end - start) * span * streams <= total:
            break
        at = parts.index((start, end, span))
        mid = (start + end) // 2
        parts[at : at + 1] = [(start, mid, span), (mid, end, span)]
    load = [0] * streams
    out = []
    for start, end, span in sorted(parts, key=lambda g: -(g[1] - g[0]) * g[2]):
        stream = load.index(min(load))
        load[stream] += (end - start) * span
        out.append((start, end, span, stream))
    return sorted(out)


def attended(lengths: list[int], group_rows: int, min_saving: int) -> int:
    """Row-positions one decode step reads for rows of these lengths (slot order)."""
    return sum(
        (end - start) * span for start, end, span in span_groups(lengths, group_rows, min_saving)
    )


def sorted_order(lengths: dict[int, int], group_rows: int, min_saving: int) -> list[int] | None:
    """The live slots (``lengths`` by slot) shortest first, if moving them into that
    order (to slots ``0..n-1``) would cut the rows' reads to :data:`SORT_GAIN` or less;
    else None."""
    if len(lengths) <= group_rows:
        return None  # one group either way
    by_slot = [lengths.get(s, 0) for s in range(max(lengths) + 1)]
    order = sorted(lengths, key=lambda s: (lengths[s], s))
    now = attended(by_slot, group_rows, min_saving)
    after = attended([lengths[s] for s in order], group_rows, min_saving)
    return order if after <= SORT_GAIN * now else None
