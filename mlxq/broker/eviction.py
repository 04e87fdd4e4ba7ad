"""Refusing a Redis that may evict keys: mlxq's jobs and results must never vanish.

A Redis with a ``maxmemory`` limit and any ``maxmemory-policy`` but ``noeviction`` deletes
keys when full; RQ job hashes and results go first and nothing reports it (rq/rq#1955).
``noeviction`` makes a full Redis refuse writes instead, which mlxq reports and retries.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

SAFE_POLICY = "noeviction"


def maxmemory_policy(conn: redis.Redis) -> str | None:
    """The server's ``maxmemory-policy``, or None when it cannot be read.

    ``INFO memory`` first (managed services that disable CONFIG still answer it), then
    ``CONFIG GET``.
    """
    try:
        policy = conn.info("memory").get("maxmemory_policy")
        if policy:
            return str(policy)
    except redis.ResponseError:
        pass
    try:
        return conn.config_get("maxmemory-policy").get("maxmemory-policy") or None
    except redis.ResponseError:
        return None


def eviction_problem(policy: str | None, host: str = "HOST", port: int | str = 6379) -> str | None:
    """One line saying why this Redis will not do and how to fix it (None if it will)."""
    if policy is None or policy == SAFE_POLICY:
        return None
    return (
        f"Redis evicts keys when full (maxmemory-policy is {policy}), which silently loses "
        f"queued jobs and results; mlxq needs maxmemory-policy {SAFE_POLICY}: run "
        f"`redis-cli -h {host} -p {port} CONFIG SET maxmemory-policy {SAFE_POLICY}` and put "
        f"`maxmemory-policy {SAFE_POLICY}` in redis.conf; on a managed service without CONFIG "
        f"(ElastiCache, Memorystore, Azure Cache, ...) set maxmemory-policy to {SAFE_POLICY} "
        "in its parameter group or settings"
    )


DEFAULT_PROTO_MAX_BULK_LEN = 512 * 1024 * 1024  # Redis's default, assumed where CONFIG is denied


@dataclass(frozen=True)
class ServerLimits:
    """What a Redis server lets a worker write: its eviction policy (None when unreadable),
    its ``maxmemory`` (0 for none) and the largest value one command may carry."""

    policy: str | None
    maxmemory: int = 0
    proto_max_bulk_len: int = DEFAULT_PROTO_MAX_BULK_LEN


def server_limits(conn: redis.Redis) -> ServerLimits:
    """The server's limits, read as :func:`maxmemory_policy` reads the policy (``INFO
    memory``, then ``CONFIG GET``); a limit that cannot be read is Redis's default."""
    try:
        memory = conn.info("memory")
    except redis.ResponseError:
        memory = {}
    policy = memory.get("maxmemory_policy") or maxmemory_policy(conn)
    bulk = DEFAULT_PROTO_MAX_BULK_LEN
    try:
        bulk = int(conn.config_get("proto-max-bulk-len").get("proto-max-bulk-len") or bulk)
    except (redis.ResponseError, ValueError):
        pass  # CONFIG denied (managed services, mlxq's ACL): Redis's default holds there
    return ServerLimits(policy, int(memory.get("maxmemory") or 0), bulk)
