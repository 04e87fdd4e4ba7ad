"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models that live workers serve.

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


def list_models(conn: redis.Redis) -> list[dict[str, Any]]:
    """OpenAI model objects, one per model served by at least one live worker."""
    first_seen: dict[str, float] = {}
    for info in fleet.live_workers(conn):
        first_seen[info.model] = min(first_seen.get(info.model, info.started_at), info.started_at)
    return [_model(model, started) for model, started in sorted(first_seen.items())]


def get_model(conn: redis.Redis, model_id: str) -> dict[str, Any]:
    """The OpenAI model object of ``model_id`` (a model or queue name) if a live worker
    serves it, else a 404 ``model_not_found`` that names what is served."""
    workers = fleet.live_workers(conn)
    serving = [w for w in workers if serves(w, model_id)]
    if not serving:
        raise ApiError(
            404,
            f"The model {model_id!r} does not exist here: {_unserved(model_id, workers)}",
            param="model",
            code="model_not_found",
        )
    return _model(model_id, min(w.started_at for w in serving))


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
    """Whether ``worker`` takes requests for ``model``: it runs that model, or it takes the
    model's queue (``default`` for requests that name no model)."""
    return worker.model == model or keys.queue_name_for_model(model) in worker.queues


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


def _model(model_id: str, created: float) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": "mlxq"}
