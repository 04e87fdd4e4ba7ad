"""``GET /v1/models``: the models that live workers serve.

Each worker publishes a :class:`~mlxq.wire.WorkerInfo`, refreshed with its heartbeat and
expiring when it dies (:func:`mlxq.broker.fleet.live_workers` reads them).
"""

from __future__ import annotations

from typing import Any

import redis

from mlxq.broker import fleet


def list_models(conn: redis.Redis) -> list[dict[str, Any]]:
    """OpenAI model objects, one per model served by at least one live worker."""
    first_seen: dict[str, float] = {}
    for info in fleet.live_workers(conn):
        first_seen[info.model] = min(first_seen.get(info.model, info.started_at), info.started_at)
    return [
        {"id": model, "object": "model", "created": int(started), "owned_by": "mlxq"}
        for model, started in sorted(first_seen.items())
    ]
