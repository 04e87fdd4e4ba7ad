"""Shared fixtures: a real embedded Valkey per session, flushed before each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from mlxq.server import make_server


@pytest.fixture(scope="session")
def valkey_url() -> Iterator[str]:
    """URL of an embedded Valkey server that lives for the whole test session."""
    server = make_server()
    server.start()
    try:
        yield server.connection_url + "/0"
    finally:
        server.stop()


@pytest.fixture
def conn(valkey_url: str) -> Iterator[redis.Redis]:
    """A client on a freshly flushed server."""
    client = redis.Redis.from_url(valkey_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a random-weight tiny model made with `mlxq make-model` (offline)."""
    from mlxq.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny"))
