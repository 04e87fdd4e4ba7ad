"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models that workers serve.

``GET /v1/models`` lists every model every live worker serves (a worker of several models
serves each), by the name that routes a line to it (``keys.queue_name_for_model``: the
hub id's or folder's last component, a GGUF file's name without ``.gguf``), with its full
``source`` (hub id or path) and ``"status": "live"``, and the models workers served lately
(``fleet.seen_models``) that no live worker serves now, ``"status": "asleep"``: a batch for
those waits for their workers to come back; last, the models the API was told to expect
(``mlxq api --models``) that no worker served yet, ``"status": "expected"``.

Each worker publishes a :class:`~mlxq.wire.WorkerInfo`, refreshed with its heartbeat and
expiring when it dies (:func:`mlxq.broker.fleet.live_workers` reads them). A name is served
when a live worker runs that model or takes the name's queue (its last path component, as
``mlxq submit --model`` picks it), so ``mlx-community/Foo-4bit`` and ``Foo-4bit`` both are
when a worker runs ``mlx-community/Foo-4bit``. Batches are judged the same way, except
that a batch also waits for a model that workers served lately and that none serves right
now (a fleet of laptops, all asleep): it runs when one comes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from mlxq.api.errors import ApiError
from mlxq.broker import fleet, keys, routing
from mlxq.wire import SeenModel, WorkerInfo


def list_models(conn: redis.Redis, expected: Sequence[str] = ()) -> list[dict[str, Any]]:
    """OpenAI model objects by routing name: each model a live worker serves (``live``),
    then each served lately that none serves now (``asleep``), then each of ``expected``
    that neither names (``expected``: a batch for it waits for its first worker)."""
    live: dict[str, tuple[float, str]] = {}  # name: (first worker's start, source)
    for w in fleet.live_workers(conn):
        for source in w.models or [w.model]:
            name = keys.queue_name_for_model(source)
            if name not in live or w.started_at < live[name][0]:
                live[name] = (w.started_at, source)
    asleep: dict[str, tuple[float, str]] = {}  # name: (last seen, source)
    for seen in fleet.seen_models(conn):
        name = keys.queue_name_for_model(seen.model)
        if name not in live and (name not in asleep or seen.seen_at > asleep[name][0]):
            asleep[name] = (seen.seen_at, seen.model)
    coming = {
        name: source
        for source in expected
        if (name := keys.queue_name_for_model(source)) not in live and name not in asleep
    }
    return [
        *(_model(name, t, source, "live") for name, (t, source) in sorted(live.items())),
        *(_model(name, t, source, "asleep") for name, (t, source) in sorted(asleep.items())),
        *(_model(name, 0, source, "expected") for name, source in sorted(coming.items())),
    ]


def get_model(conn: redis.Redis, model_id: str, expected: Sequence[str] = ()) -> dict[str, Any]:
    """The OpenAI model object of ``model_id`` (a model or queue name) if a live worker
    serves it (``live``), one served it lately (``asleep``) or the API expects it
    (``expected``), else a 404 ``model_not_found`` that names what is served."""
    workers = fleet.live_workers(conn)
    serving = [w for w in workers if serves(w, model_id)]
    if serving:
        first = min(serving, key=lambda w: w.started_at)
        return _model(model_id, first.started_at, _source(first, model_id), "live")
    seen = [s for s in fleet.seen_models(conn) if serves(s, model_id)]
    if seen:
        last = max(seen, key=lambda s: s.seen_at)
        return _model(model_id, last.seen_at, _source(last, model_id), "asleep")
    for source in expected:
        if routing.same_model(model_id, source):
            return _model(model_id, 0, source, "expected")
    raise ApiError(
        404,
        f"The model {model_id!r} does not exist here: {_unserved(model_id, workers)}",
        param="model",
        code="model_not_found",
    )


def unserved_problem(
    conn: redis.Redis, model: str | None, expected: Sequence[str] = ()
) -> str | None:
    """Why requests for ``model`` (None: requests that name none) would wait for a worker
    that does not exist, or None when one serves them: a live worker, one seen within
    ``keys.SEEN_FOR_S`` (asleep, or restarting: the batch waits for it), or a model the
    API was told to expect (``mlxq api --models``)."""
    workers = fleet.live_workers(conn)
    if any(serves(w, model) for w in workers):
        return None
    if any(serves(s, model) for s in fleet.seen_models(conn)):
        return None
    if model is not None and any(routing.same_model(model, m) for m in expected):
        return None
    return _unserved(model, workers)


def serves(worker: WorkerInfo | SeenModel, model: str | None) -> bool:
    """Whether ``worker`` takes requests for ``model``: it serves that model (by any of its
    names, on whichever queues: a batch is routed to them), or it takes the model's queue
    (``default`` for requests that name no model)."""
    models = [worker.model, *getattr(worker, "models", ())]
    if model is not None and any(routing.same_model(model, m) for m in models):
        return True
    return keys.queue_name_for_model(model) in worker.queues


def _unserved(model: str | None, workers: list[WorkerInfo]) -> str:
    """A line saying that nothing serves ``model``, what is served, and the fixes."""
    served = _served(workers)
    if model is None:
        queue = keys.queue_name_for_model(None)
        return (
            f"the requests name no model, so they go to queue {queue!r}, which no live mlxq "
            f"worker takes; served: {served}; start `mlxq worker --model MODEL -q {queue}` "
            "or name a served model in body.model"
        )
    return (
        f"model {model!r} is not served by any mlxq worker, live or seen in the last "
        f"{keys.SEEN_FOR_S // 86400} days; served: {served}; start `mlxq worker --model "
        f"{model}`, name a served model, or start `mlxq api --models {model}` to queue "
        "it for workers started later"
    )


def _served(workers: list[WorkerInfo]) -> str:
    """The live workers' models, each with its queues where they are not just its own."""
    names: set[str] = set()
    for w in workers:
        own = w.queues == [keys.queue_name_for_model(w.model)]
        names.add(w.model if own else f"{w.model} (queues {', '.join(w.queues)})")
    return ", ".join(sorted(names)) or "none (no live worker)"


def _source(worker: WorkerInfo | SeenModel, model_id: str) -> str:
    """The model ``worker`` serves as ``model_id`` (a model, its routing name, or one of the
    worker's queues: then the model it runs)."""
    models = [worker.model] if isinstance(worker, SeenModel) else worker.models or [worker.model]
    queue = keys.queue_name_for_model(model_id)
    for m in models:
        if m == model_id or keys.queue_name_for_model(m) == queue:
            return m
    return worker.model


def _model(model_id: str, created: float, source: str, status: str) -> dict[str, Any]:
    """An OpenAI model object, with mlxq's ``source`` (hub id or path) and ``status``."""
    return {
        "id": model_id,
        "object": "model",
        "created": int(created),
        "owned_by": "mlxq",
        "source": source,
        "status": status,
    }
