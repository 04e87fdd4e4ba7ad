"""Which queue each request of a batch goes to: the one of the model its line names.

A line that names no model, or the batch's own ``model`` (the same model when both give the
same queue name, :func:`~mlxq.broker.keys.queue_name_for_model`: a hub id and a local
folder of it match), goes to the batch's ``queue``; a line naming another model goes to that
model's queue. The plan is kept in the batch record (``BatchInfo.models``), so a resumed
submit routes every line as the first part did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlxq.broker import keys
from mlxq.broker.rq_store import counters, states
from mlxq.wire import BatchInfo, BatchModel, ModelProgress, Request, WorkerInfo


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two model names stand for one model (one queue name), as workers match them."""
    return (
        a is not None
        and b is not None
        and (a == b or keys.queue_name_for_model(a) == keys.queue_name_for_model(b))
    )


def plan(
    requests: Sequence[Request],
    queue: str,
    model: str | None,
    queue_of: Callable[[str], str] = keys.queue_name_for_model,
) -> list[BatchModel]:
    """The models the requests name, in order of first appearance, with how many lines each
    and its queue (``queue_of`` a model name; ``queue`` for lines naming none or ``model``)."""
    counts: dict[str | None, int] = {}
    for req in requests:
        counts[req.model] = counts.get(req.model, 0) + 1
    return [
        BatchModel(queue=_queue(name, queue, model, queue_of), lines=n, model=name)
        for name, n in counts.items()
    ]


def _queue(name: str | None, queue: str, model: str | None, queue_of: Callable[[str], str]) -> str:
    if name is None or same_model(name, model):
        return queue
    return queue_of(name)


def queues_of(requests: Sequence[Request], info: BatchInfo) -> list[str]:
    """The queue of each request, by the batch's plan (``info.queue`` where it has none)."""
    planned = {m.model: m.queue for m in info.models}
    return [planned.get(req.model, info.queue) for req in requests]


def model_names(info: BatchInfo) -> dict[str, list[str]]:
    """Each queue of the batch and the models whose lines went there (the batch's ``model``,
    or ``(none)``, for lines naming none)."""
    out: dict[str, list[str]] = {}
    for m in info.models or [BatchModel(queue=info.queue, lines=info.total, model=info.model)]:
        names = out.setdefault(m.queue, [])
        name = m.model or info.model or "(none)"
        if name not in names:
            names.append(name)
    return out


def progress(info: BatchInfo, counts: dict[bytes, bytes]) -> list[ModelProgress]:
    """The batch's counts per queue, with the models of each, from its counters hash (empty
    for a batch made before batches could mix models)."""
    if not info.models:
        return []
    per_queue = counters.read_queue_counts(counts)
    lines: dict[str, int] = {}
    for m in info.models:
        lines[m.queue] = lines.get(m.queue, 0) + m.lines
    empty = dict.fromkeys(states.BUCKETS, 0)
    return [
        ModelProgress(queue, models, lines[queue], per_queue.get(queue, empty))
        for queue, models in model_names(info).items()
    ]


def unserved(models: Sequence[BatchModel], workers: Sequence[WorkerInfo]) -> list[BatchModel]:
    """The models (of a plan) whose queue no live worker of ``workers`` takes."""
    served = {name for w in workers for name in w.queues}
    return [m for m in models if m.queue not in served]


def describe(models: Sequence[BatchModel]) -> str:
    """``2 lines for model 'A' (queue 'A'), 1 line naming no model (queue 'default')``."""
    return ", ".join(
        f"{m.lines} line{'s' if m.lines != 1 else ''} "
        + (f"for model {m.model!r}" if m.model else "naming no model")
        + f" (queue {m.queue!r})"
        for m in models
    )
