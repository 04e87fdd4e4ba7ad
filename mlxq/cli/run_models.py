"""The models of an ``mlxq run``: its file's lines may name several.

``--model`` is the model of the lines that name none (without it, the first model a line
names). Each model gets the run's private queue of its own (``run-BATCH`` for ``--model``'s
lines, ``run-BATCH-NAME`` for another model's), and the run serves them one after another,
in order of first appearance, each on its own burst worker. Models are told apart as
workers tell them (:func:`mlxq.broker.routing.same_model`: by queue name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from mlxq.broker import keys, routing
from mlxq.engine.stats import EngineStats
from mlxq.wire import BatchInfo, Request


def first_named(requests: Sequence[Request]) -> str | None:
    """The first model a line names (the default of a run given no ``--model``)."""
    return next((req.model for req in requests if req.model), None)


def models_to_serve(requests: Sequence[Request], default: str) -> list[str]:
    """The models the lines need, ``default`` for lines naming none, in order of first
    appearance. A line naming ``default``'s model by another spelling (``tiny`` for
    ``--model models/tiny``) is ``default``'s: the spelling given on the command line is
    the one that loads."""
    out: list[str] = []
    for req in requests:
        named = req.model
        name = default if not named or routing.same_model(named, default) else named
        if not any(routing.same_model(name, seen) for seen in out):
            out.append(name)
    return out


def named_by(requests: Sequence[Request], model: str) -> str:
    """Which lines name ``model``: how many, and the first (1-based, in request order)."""
    at = [i for i, req in enumerate(requests) if routing.same_model(req.model, model)]
    first = f" (the first: request {at[0] + 1})" if at else ""
    many = f"{len(at)} requests name" if len(at) != 1 else "1 request names"
    return f"{many} model {model!r}{first}"


def private_queues(queue: str) -> Callable[[str], str]:
    """The run's queue of a model its lines name, beside the run's own ``queue``."""
    return lambda model: f"{queue}-{keys.queue_name_for_model(model)}"


def queue_of(info: BatchInfo, model: str) -> str:
    """The queue the batch's lines for ``model`` went to."""
    for m in info.models:
        if m.model is not None and routing.same_model(m.model, model):
            return m.queue
    return info.queue


def summed(parts: Sequence[EngineStats]) -> EngineStats:
    """The work of several engines as one (the prefix cache's size: the last one's)."""
    total = EngineStats()
    for part in parts:
        for f in dataclasses.fields(part):
            if f.name != "prefix_cache_bytes":
                setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))
        total.prefix_cache_bytes = part.prefix_cache_bytes
    return total
