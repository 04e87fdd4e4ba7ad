"""Which queue each request of a batch goes to: one whose workers serve the model it names.

A line that names no model, or the batch's own ``model`` (the same model when both give the
same queue name, :func:`same_model`: a hub id and a local folder of it match), goes to the
batch's ``queue``. A line naming another model goes, with the fleet known (:class:`Fleet`:
live workers, and the models workers served lately), to a queue that its model's workers
serve and no other model's workers take from (a worker refuses a job naming a model it does
not serve): the batch's queue first when it was given (``--queue``), else the model's own
queue, then the other queues of that model's workers; live workers before recently seen
ones; failing all that, the model's own queue (:func:`~mlxq.broker.keys.queue_name_for_model`).
Without the fleet, a named line goes to ``queue_of`` its model. The plan is kept in the batch
record (``BatchInfo.models``), so a resumed submit routes every line as the first part did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from mlxq.broker import keys
from mlxq.broker.rq_store import counters, states
from mlxq.wire import BatchInfo, BatchModel, ModelProgress, Request, SeenModel, WorkerInfo


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two model names stand for one model (one queue name), as workers match them."""
    return (
        a is not None
        and b is not None
        and (a == b or keys.queue_name_for_model(a) == keys.queue_name_for_model(b))
    )


# -- the fleet, as routing sees it ---------------------------------------------------------
@dataclass(frozen=True)
class Listener:
    """A worker's models and queues: a live worker, or a model that some worker served
    lately (``seen_at``) and that no live worker serves now."""

    models: tuple[str, ...]
    queues: tuple[str, ...]
    live: bool
    seen_at: float | None = None
    adapter: str | None = None  # the worker's LoRA adapter on its model

    def serves(self, model: str | None) -> bool:
        """Whether it runs a job naming ``model`` (vetting: a model it serves)."""
        return any(same_model(model, m) for m in self.models)


class Fleet:
    """Which models the workers listening on each queue run: what routing and the submit's
    warnings read (:meth:`read`, or :meth:`of` records)."""

    def __init__(self, listeners: Sequence[Listener]) -> None:
        self.listeners = list(listeners)

    @classmethod
    def of(cls, workers: Sequence[WorkerInfo], seen: Sequence[SeenModel] = ()) -> Fleet:
        """Live workers (a stalled one's record is not), then the models seen lately that
        none of them serves."""
        live = [
            Listener(tuple(w.models or [w.model]), tuple(w.queues), True, adapter=w.adapter_path)
            for w in workers
            if w.state != "stalled"
        ]
        gone = [
            Listener((s.model,), tuple(s.queues), False, s.seen_at, s.adapter)
            for s in seen
            if not any(w.serves(s.model) for w in live)
        ]
        return cls(live + gone)

    @classmethod
    def read(cls, conn: redis.Redis) -> Fleet:
        from mlxq.broker import fleet

        return cls.of(fleet.live_workers(conn), fleet.seen_models(conn))

    def on(self, queue: str, live: bool | None = None) -> list[Listener]:
        """The listeners of ``queue`` (only the live ones, or only the others)."""
        return [x for x in self.listeners if queue in x.queues and live in (None, x.live)]

    def answering(self, listener: Listener, queue: str) -> tuple[str, ...]:
        """The models ``listener`` runs a job naming none on, taken from ``queue``: a worker
        of several models takes from a model's own queue only with that model loaded, from
        a shared queue with any. (A model seen lately is one record per model, each with
        all its worker's queues: another model's own queue among them is not its own.)"""
        own = tuple(m for m in listener.models if keys.queue_name_for_model(m) == queue)
        if own or listener.live:
            return own or listener.models
        siblings = (
            x
            for x in self.listeners
            if not x.live and x.queues == listener.queues and x is not listener
        )
        if any(keys.queue_name_for_model(m) == queue for x in siblings for m in x.models):
            return ()
        return listener.models

    def models_answering(self, queue: str, live: bool | None = None) -> list[str]:
        """Every model a job naming none may run on from ``queue`` (one name per model)."""
        out: list[str] = []
        for x in self.on(queue, live):
            for m in self.answering(x, queue):
                if not any(same_model(m, seen) for seen in out):
                    out.append(m)
        return out

    def models_served(self, live: bool | None = True) -> list[tuple[str, list[str]]]:
        """Every model the workers serve (live ones, or only the others; one name each),
        with the queues its workers listen on."""
        out: list[tuple[str, list[str]]] = []
        for x in self.listeners:
            if live not in (None, x.live):
                continue
            for m in x.models:
                found = next((qs for o, qs in out if same_model(m, o)), None)
                if found is None:
                    out.append((m, list(x.queues)))
                else:
                    found += [q for q in x.queues if q not in found]
        return out

    def serves(self, queue: str, model: str | None, live: bool | None = True) -> bool:
        """Whether a worker on ``queue`` runs its jobs naming ``model`` (``model`` None:
        whether any worker takes from it)."""
        if model is None:
            return bool(self.on(queue, live))
        return any(x.serves(model) for x in self.on(queue, live))

    def route(self, model: str, queue: str, given: bool = True, pin: bool = False) -> str:
        """The queue for lines naming ``model``: one whose workers serve it and where no
        other model's worker would take them (``pin``: for lines naming none, every worker
        there runs them on ``model``). The batch's ``queue`` first if ``given``, else the
        model's own; then the other queues of its workers; live workers before those seen
        lately; a worker's queue for its model with an adapter only when asked for. None
        fits: the model's own queue."""
        own = keys.queue_name_for_model(model)
        order = [queue, own] if given else [own, queue]
        order += [q for x in self.listeners if x.serves(model) and not x.adapter for q in x.queues]
        best: tuple[int, str] | None = None
        for q in dict.fromkeys(order):
            tier = self._fit(q, model, pin)
            if tier is not None and (best is None or tier < best[0]):
                best = (tier, q)
        return best[1] if best else own

    def _fit(self, queue: str, model: str, pin: bool) -> int | None:
        """How well ``queue`` fits lines naming ``model``: 0 served by live workers only of
        it, 1 the same but a worker of another model seen lately listens there too, 2
        served only by workers seen lately (none live), None unfit."""

        def serving(x: Listener) -> bool:
            return (
                any(same_model(model, m) for m in self.answering(x, queue))
                if pin
                else (x.serves(model))
            )

        def other(x: Listener) -> bool:
            # a line naming a model runs only on it: a worker serving it takes no other
            if pin:
                return any(not same_model(model, m) for m in self.answering(x, queue))
            return not x.serves(model)

        live, gone = self.on(queue, True), self.on(queue, False)
        if live:
            if any(other(x) for x in live) or not any(serving(x) for x in live):
                return None
            return 1 if any(other(x) for x in gone) else 0
        if any(serving(x) for x in gone) and not any(other(x) for x in gone):
            return 2
        return None


# -- the plan ---------------------------------------------------------------------------
def plan(
    requests: Sequence[Request],
    queue: str,
    model: str | None,
    queue_of: Callable[[str], str] = keys.queue_name_for_model,
    fleet: Fleet | None = None,
    given: bool = True,
) -> list[BatchModel]:
    """The models the requests name, in order of first appearance, with how many lines each
    and its queue: ``queue`` for lines naming none or ``model``; for the others, with
    ``fleet``, :meth:`Fleet.route` (``given``: ``queue`` was asked for, it comes first),
    without it ``queue_of`` the model."""
    counts: dict[str | None, int] = {}
    for req in requests:
        counts[req.model] = counts.get(req.model, 0) + 1
    out = []
    for name, n in counts.items():
        if name is None or same_model(name, model):
            routed = queue
        elif fleet is not None:
            routed = fleet.route(name, queue, given)
        else:
            routed = queue_of(name)
        out.append(BatchModel(queue=routed, lines=n, model=name))
    return out


def batch_queue(model: str | None, fleet: Fleet | None = None) -> str:
    """The queue of a batch given no ``--queue``: one whose workers all run ``model``
    (:meth:`Fleet.route`, pinned), else ``model``'s own queue; ``default`` without one."""
    if model is None:
        return keys.DEFAULT_QUEUE
    own = keys.queue_name_for_model(model)
    return fleet.route(model, own, given=False, pin=True) if fleet is not None else own


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


# -- what submit says about a plan --------------------------------------------------------
def unserved(
    models: Sequence[BatchModel], fleet: Fleet, model: str | None = None, live: bool = True
) -> list[BatchModel]:
    """The parts of a plan that no worker on their queue runs: live workers (``live``), or
    any seen lately (``live`` None). A part naming no model is the batch ``model``'s, or,
    without one, any worker's."""
    return [m for m in models if not fleet.serves(m.queue, m.model or model, live)]


def mixed(models: Sequence[BatchModel], fleet: Fleet) -> list[tuple[BatchModel, list[str]]]:
    """The parts of a plan naming no model whose queue's workers (live, or seen lately) run
    them on more than one model: their answers mix models. Each with those models."""
    out = []
    for m in models:
        if m.model is not None:
            continue
        runs = fleet.models_answering(m.queue)
        if len(runs) > 1:
            out.append((m, runs))
    return out


def last_seen(fleet: Fleet, m: BatchModel, model: str | None = None) -> float | None:
    """When a worker (seen lately, none live) that runs the part ``m`` on its queue was
    last seen, or None."""
    name = m.model or model
    times = [
        x.seen_at
        for x in fleet.on(m.queue, False)
        if x.seen_at is not None and (name is None or x.serves(name))
    ]
    return max(times) if times else None


def describe(models: Sequence[BatchModel], model: str | None = None) -> str:
    """``2 lines for model 'A' (queue 'A'), 1 line naming no model (queue 'default')`` (``1
    line naming no model, for --model 'M' (queue 'M')`` given the batch's ``model``)."""
    return ", ".join(
        f"{m.lines} line{'s' if m.lines != 1 else ''} "
        + (
            f"for model {m.model!r}"
            if m.model
            else "naming no model" + (f", for --model {model!r}" if model else "")
        )
        + f" (queue {m.queue!r})"
        for m in models
    )
