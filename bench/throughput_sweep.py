"""``throughput.py --batch A,B,...``: the batch sizes one run compares, side by side.

Each size is mlxq's configuration at that batch (``auto``: what the worker picks on this
device, :func:`mlxq.engine.scheduler.choose_batch`). Modes that take a batch (``raw`` and
the ``mlxq`` modes) run once per size on the same workload; mlx-lm's own modes once.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

# Modes whose batch is mlxq's: run at every size of a sweep.
BATCHED_MODES = ("raw", "mlxq", "mlxq-bg", "mlxq-direct")


@dataclass(frozen=True)
class Sizing:
    """mlxq's configuration at one batch size: the profile, its scheduler, and why."""

    batch: int
    source: str  # "given" or "auto"
    why: str  # the worker's line saying which limit decided it
    profile: Any  # WorkerProfile
    scheduler: Any  # Scheduler


class Variant(NamedTuple):
    """One timed run of a workload: a mode, its prefix cache bytes, the size index."""

    mode: str
    cache_bytes: int
    size: int

    def label(self, sweep: bool, sizes: list[Sizing]) -> str:
        """The row name: the mode, ``+prefix``, and ``@BATCH`` in a sweep."""
        name = self.mode + ("+prefix" if self.cache_bytes else "")
        return f"{name}@{sizes[self.size].batch}" if sweep else name


def parse_batches(text: str | None) -> list[int | None]:
    """``--batch``: comma-separated sizes, ``auto`` (None) for mlxq's own; ValueError
    names a bad one."""
    if text is None:
        return [None]
    out: list[int | None] = []
    for part in (p.strip() for p in text.split(",")):
        if part == "auto":
            out.append(None)
            continue
        try:
            value = int(part)
        except ValueError as e:
            raise ValueError(f"{part!r} is not a batch size (a number or 'auto')") from e
        if value < 1:
            raise ValueError(f"{value} is below 1")
        out.append(value)
    if len(set(out)) != len(out):
        raise ValueError(f"{text!r} names a size twice")
    return out


def make_sizes(args: argparse.Namespace, info: Any) -> list[Sizing]:
    """mlxq's sizing at each ``--batch`` size, in the order given."""
    from mlxq.engine.hardware import device_facts
    from mlxq.worker.config import resolve
    from mlxq.worker.launch import build_scheduler
    from mlxq.worker.profile import WorkerProfile

    facts, sizes = device_facts(), []
    for given in args.batches:
        extra = {"prefill_batch": args.prefill_batch} if args.prefill_batch else {}
        profile = WorkerProfile(max_batch=given, kv_bits=args.kv_bits, **extra)
        config = resolve(profile, facts, info)
        source = "given" if given else f"auto: {config.batch.limit}"
        if any(s.batch == config.max_batch for s in sizes):
            print(f"--batch: {config.max_batch} ({source}) runs once", file=sys.stderr)
            continue
        sizes.append(
            Sizing(config.max_batch, source, config.batch.why, profile, build_scheduler(config))
        )
    return sizes


def variants_of(
    modes: list[str], sizes: list[Sizing], prefix: str, workload: str, budget: int, share: float
) -> list[Variant]:
    """The runs of one workload: each mode at each size (mlx-lm's own modes once), the
    prefix cache off and/or on (``prefix``) for the mlxq modes on the prefix workload."""
    out = []
    for mode in modes:
        caches = [0]
        if mode.startswith("mlxq") and workload == "prefix" and prefix != "off":
            on = max(1, int(budget * share))
            caches = [on] if prefix == "on" else [0, on]
        indices = range(len(sizes)) if mode in BATCHED_MODES else range(1)
        out += [Variant(mode, c, i) for i in indices for c in caches]
    return out
