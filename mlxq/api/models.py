"""``GET /v1/models``: the models that live workers serve.

Each worker publishes a :class:`~mlxq.wire.WorkerInfo` under ``keys.worker_info(name)``,
refreshed with its heartbeat and expiring when it dies; its name is in the set
``keys.workers()``. Names whose info has expired are skipped (and left for the workers'
own pruning).
"""

from __future__ import annotations

from typing import Any

import msgspec
import redis

from mlxq.broker import keys
from mlxq.wire import WorkerInfo

_info_decoder = msgspec.json.Decoder(WorkerInfo)


def live_workers(conn: redis.Redis) -> list[WorkerInfo]:
    """The published info of every live worker, by name."""
    names = sorted(n.decode() for n in conn.smembers(keys.workers()))
    if not names:
        return []
    raws = conn.mget([keys.worker_info(n) for n in names])
    out = []
    for raw in raws:
        if raw is None:
            continue
        try:
            out.append(_info_decoder.decode(raw))
        except msgspec.MsgspecError:  # written by another version: skip rather than fail
            continue
    return out


def list_models(conn: redis.Redis) -> list[dict[str, Any]]:
    """OpenAI model objects, one per model served by at least one live worker."""
    first_seen: dict[str, float] = {}
    for info in live_workers(conn):
        first_seen[info.model] = min(first_seen.get(info.model, info.started_at), info.started_at)
    return [
        {"id": model, "object": "model", "created": int(started), "owned_by": "mlxq"}
        for model, started in sorted(first_seen.items())
    ]
