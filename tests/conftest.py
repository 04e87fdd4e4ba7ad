"""Shared fixtures: a real embedded Valkey per session, flushed before each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from mlxq.engine.eval_order import widen
from mlxq.engine.hardware import backend_name
from mlxq.server import make_server
from tests.helpers import TEST_PRESET, Worker

# MLX's evaluation order as `mlxq worker` sets it, before anything in the tests evaluates.
widen(backend_name())


@pytest.fixture(scope="session")
def valkey_url() -> Iterator[str]:
    """URL of an embedded Valkey server that lives for the whole test session."""
    server = make_server()
    server.start()
    try:
        yield server.connection_url + "/0"
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test() -> Iterator[None]:
    """Stop the workers a test started and left running (it failed before its own stop):
    a leaked worker would heartbeat into every later test's Redis."""
    before = set(Worker.running)
    yield
    for worker in Worker.running - before:
        worker.stop()


@pytest.fixture
def conn(valkey_url: str) -> Iterator[redis.Redis]:
    """A client on a freshly flushed server."""
    client = redis.Redis.from_url(valkey_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the random-weight ``tiny`` preset (seed 0), made once per session.
    ``MLXQ_TEST_PRESET`` names another preset for a run elsewhere: on a GPU, ``cpu-small``
    (heads of 64) puts the worker tests on the CUDA ragged attention, which ``tiny``'s
    heads of 16 never take."""
    from mlxq.engine.models.make import make_model

    return make_model(tmp_path_factory.mktemp("models") / TEST_PRESET, TEST_PRESET)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> str:
    """The tiny model's path as a string, as the CLI and profiles take it."""
    return str(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the tiny model, loaded once with ``mlx_lm.load``."""
    import mlx_lm

    return mlx_lm.load(str(tiny_model_dir))


# -- mlxq api (test_api.py, test_api_files.py) ----------------------------------------------


@pytest.fixture(scope="module")
def ports(valkey_url: str) -> Iterator[tuple[int, int]]:
    """Two API processes' worth of servers on one Redis: A polls lazily, B also sweeps."""
    from api_servers import serve

    a, ta, port_a = serve(valkey_url, sweep_interval=0)
    b, tb, port_b = serve(valkey_url, sweep_interval=0.2)
    yield port_a, port_b
    for server, thread in ((a, ta), (b, tb)):
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def client(ports: tuple[int, int], conn: redis.Redis) -> Any:
    """An ``openai`` client of server A (Redis flushed: ``conn``)."""
    from api_servers import api_client

    return api_client(ports[0])


@pytest.fixture
def client_b(ports: tuple[int, int], conn: redis.Redis) -> Any:
    """An ``openai`` client of server B."""
    from api_servers import api_client

    return api_client(ports[1])
