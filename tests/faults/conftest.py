"""Fixtures of the fault tests: long-lived worker processes, as users run them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.helpers import Worker


@pytest.fixture
def start(
    valkey_url: str, tiny_model: str, conn: redis.Redis, tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    """Start a long-lived ``mlxq worker --model tiny ARGS...`` (its default queues unless
    ARGS say otherwise) and wait until it has loaded its model; stopped at the end."""
    started: list[Worker] = []

    def _start(*args: str) -> Worker:
        worker = Worker(valkey_url, tiny_model, *args, log=tmp_path / f"w{len(started)}.log")
        started.append(worker)
        worker.wait_listening(conn)
        return worker

    yield _start
    for worker in started:
        worker.stop()


@pytest.fixture(scope="session")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny random-weight models of different names and weights: alpha and beta."""
    from mlxq.engine.models.make import make_model

    root = tmp_path_factory.mktemp("two-models")
    return str(make_model(root / "alpha", "tiny", seed=1)), str(
        make_model(root / "beta", "tiny", seed=2)
    )
