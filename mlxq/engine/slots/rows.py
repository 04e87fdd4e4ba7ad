"""The slot engine's decoding rows by slot, with what each decode step reads of them kept.

A decode step is host-bound on CUDA (the next one is built while the last computes), so
what the engine does per row per step is the step's time. :class:`RowTable` is the
engine's ``{slot: Row}`` dict that also keeps, as rows come and go, the rows in slot order
(rebuilt only after a change) and how many rows need per-row work that most do not (logits
processors, logprobs), so a step over rows that need none skips it without looking at
each row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mlxq.engine.slots.step import Row

# Rows by slot: a mapping, or ``(slot, row)`` pairs.
Rows = Mapping[int, Row] | Iterable[tuple[int, Row]]


class RowTable(dict[int, Row]):
    """Rows by slot (a dict: reads as fast as one) and views of them kept up to date."""

    def __init__(self, rows: Rows = ()) -> None:
        super().__init__()
        self._ordered: list[Row] | None = []
        self.processors = 0  # rows with per-row logits processors
        self.logprobs = 0  # rows whose request asks for logprobs
        self.update(rows)

    def ordered(self) -> list[Row]:
        """The rows in slot order (the same list until the rows change: do not modify)."""
        if self._ordered is None:
            self._ordered = [self[slot] for slot in sorted(self)]
        return self._ordered

    def _count(self, row: Row, sign: int) -> None:
        self._ordered = None
        self.processors += sign * bool(row.processors)
        self.logprobs += sign * (row.run.job.request.logprobs is not None)

    # Every way to change the dict goes through these, so the views follow.

    def __setitem__(self, slot: int, row: Row) -> None:
        old = super().get(slot)
        if old is not None:
            self._count(old, -1)
        super().__setitem__(slot, row)
        self._count(row, 1)

    def __delitem__(self, slot: int) -> None:
        self._count(self[slot], -1)
        super().__delitem__(slot)

    def pop(self, slot: int, *default: Row) -> Row:  # type: ignore[override]
        """Remove and return the row in ``slot`` (``default`` if none, else KeyError)."""
        if slot not in self:
            return super().pop(slot, *default)
        row = self[slot]
        del self[slot]
        return row

    def popitem(self) -> tuple[int, Row]:
        """Remove and return the row last added (as ``dict.popitem``)."""
        slot, row = super().popitem()
        self._count(row, -1)
        return slot, row

    def setdefault(self, slot: int, row: Row) -> Row:  # type: ignore[override]
        """The row in ``slot``, else ``row`` put there."""
        if slot not in self:
            self[slot] = row
        return self[slot]

    def update(self, rows: Rows = (), **more: Row) -> None:  # type: ignore[override]
        """Put rows (a mapping or ``(slot, row)`` pairs) into their slots."""
        pairs = rows.items() if isinstance(rows, Mapping) else rows
        for slot, row in [*pairs, *more.items()]:
            self[slot] = row

    def __ior__(self, rows: Rows) -> RowTable:  # type: ignore[override]
        self.update(rows)
        return self

    def clear(self) -> None:
        """Remove every row."""
        super().clear()
        self._ordered, self.processors, self.logprobs = [], 0, 0
