"""``mlxq api`` says which models are served: ``GET /v1/models/{id}`` for a model or queue
name (hub ids hold a "/"), and a batch for a model no live worker serves fails validation
with ``model_not_found``, unless ``--allow-unserved-models``: through the official ``openai``
client, a real ``mlxq worker`` and real ``mlxq api`` processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import openai
import pytest
from api_servers import (
    CHAT,
    KEY,
    api_client,
    chat_line,
    create,
    publish_worker,
    serve,
    upload,
    wait_final,
)
from helpers import ROOT, Worker, free_port, wait_for_port, worker_record
from rq.worker import Worker as RQWorker

from mlxq.api.models import unserved_problem
from mlxq.broker import fleet, keys
from tests.helpers import waiting

UNSERVED = "gpt-4o-mini"


@pytest.fixture(scope="module")
def strict_port(valkey_url: str) -> Iterator[int]:
    """An API server as ``mlxq api`` runs by default: unserved models refused."""
    server, thread, port = serve(valkey_url, sweep_interval=0.2, allow_unserved_models=False)
    yield port
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def strict(strict_port: int, conn) -> openai.OpenAI:
    return api_client(strict_port)


def _batch_for(client: openai.OpenAI, model: str | None):
    body = {"model": model} if model else {}
    lines = [chat_line(f"c{i}", "Hi", **body) for i in range(3)]
    if model is None:
        for line in lines:
            del line["body"]["model"]
    return create(client, upload(client, lines), CHAT)


def _model_not_found(batch) -> str:
    """The one error of a batch refused for its model: its message."""
    assert batch.status == "failed" and batch.failed_at is not None, batch
    [error] = batch.errors.data
    assert (error.code, error.line) == ("model_not_found", 1)
    return error.message


def test_without_a_live_worker_nothing_is_served(strict, client, conn):
    with pytest.raises(openai.NotFoundError) as e:
        strict.models.retrieve(UNSERVED)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "none (no live worker)" in e.value.body["message"]

    refused = _batch_for(strict, UNSERVED)
    assert _model_not_found(strict.batches.retrieve(refused.id)) == (
        f"model {UNSERVED!r} is not served by any mlxq worker, live or seen in the last 7 "
        f"days; served: none (no live worker); start `mlxq worker --model {UNSERVED}`, name "
        f"a served model, or start `mlxq api --models {UNSERVED}` to queue it for workers "
        "started later"
    )
    assert refused.errors.data[0].param == "body.model"
    assert waiting(conn, UNSERVED) == 0
    no_model = _model_not_found(_batch_for(strict, None))
    assert "go to queue 'default', which no live mlxq worker takes" in no_model
    # A server with --allow-unserved-models queues it for a worker started later.
    queued = _batch_for(client, UNSERVED)
    assert queued.status == "in_progress" and waiting(conn, UNSERVED) == 3


def test_hub_ids_and_their_queue_names_are_served(strict, conn):
    publish_worker(conn, "w1", "mlx-community/Foo-4bit", ["Foo-4bit"])
    publish_worker(conn, "w2", "org/Bar", ["fast", "default"])
    for name in ("mlx-community/Foo-4bit", "Foo-4bit", "org/Bar", "fast"):
        model = strict.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (name, "model", "mlxq")
    with pytest.raises(openai.NotFoundError) as e:
        strict.models.retrieve("mlx-community/Baz")  # a queue, Baz, nobody takes
    assert "served: mlx-community/Foo-4bit, org/Bar (queues fast, default)" in str(e.value)
    # (mlx-community/Bar is org/Bar by its queue name: served, as workers match models)
    assert strict.models.retrieve("mlx-community/Bar").id == "mlx-community/Bar"
    assert _batch_for(strict, "mlx-community/Foo-4bit").status == "in_progress"
    assert _batch_for(strict, None).status == "in_progress"  # w2 takes queue default
    assert waiting(conn, "Foo-4bit") == 3 and waiting(conn, "default") == 3


def test_a_batch_mixing_models_is_checked_and_queued_per_model(strict, client, conn):
    publish_worker(conn, "w1", "org/Served", ["Served"])
    lines = [
        chat_line("a", "Hi", model="org/Served"),
        chat_line("b", "Hi", model=UNSERVED),
        chat_line("c", "Hi"),
        chat_line("d", "Hi", model=UNSERVED),
    ]
    del lines[2]["body"]["model"]  # (on the batch's model's queue: the first one named)
    refused = create(strict, upload(strict, lines), CHAT)
    [error] = refused.errors.data
    assert (error.code, error.line, error.param) == ("model_not_found", 2, "body.model")
    assert UNSERVED in error.message and waiting(conn, "Served") == 0
    queued = create(client, upload(client, lines), CHAT)
    assert queued.status == "in_progress"
    assert (waiting(conn, "Served"), waiting(conn, UNSERVED)) == (2, 2)


def test_a_live_worker_serves_its_model_by_path_and_by_queue(
    strict, conn, valkey_url, tiny_model, tmp_path
):
    worker = Worker(valkey_url, tiny_model, log=tmp_path / "worker.log")
    try:
        worker.wait_listening(conn)
        assert strict.models.retrieve(tiny_model).id == tiny_model  # a path: "/" in the id
        assert strict.models.retrieve("tiny").id == "tiny"
        refused = _model_not_found(_batch_for(strict, UNSERVED))
        assert f"served: {tiny_model} (queues tiny, default);" in refused
        batch = wait_final(strict, _batch_for(strict, "tiny").id, timeout=120)
        assert batch.status == "completed" and batch.request_counts.completed == 3
    finally:
        worker.stop()


@pytest.mark.parametrize(
    ("args", "env", "status"),
    [
        ([], {}, "failed"),
        (["--allow-unserved-models"], {}, "in_progress"),
        ([], {"MLXQ_API_ALLOW_UNSERVED_MODELS": "1"}, "in_progress"),
    ],
)
def test_the_command_queues_unserved_models_only_when_allowed(
    args: list[str], env: dict[str, str], status: str, valkey_url, conn, tmp_path: Path
):
    port = free_port()
    env = {**os.environ, "MLXQ_REDIS_URL": valkey_url, "MLXQ_API_KEYS": KEY, **env}
    log = (tmp_path / "api.log").open("w")
    cmd = [sys.executable, "-m", "mlxq", "api", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=log)
    try:
        wait_for_port(port, proc, timeout=60)
        assert _batch_for(api_client(port), UNSERVED).status == status
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_batch_sent_while_every_worker_sleeps_waits_and_completes(
    strict, conn, valkey_url, tiny_model, tmp_path
):
    """A fleet of one Mac, asleep (its worker stopped) when the batch is sent: the batch is
    accepted for the model it served, stays in progress, and completes when it is back."""
    first = Worker(valkey_url, tiny_model, log=tmp_path / "first.log")
    first.wait_listening(conn)
    first.stop()
    assert not fleet.live_workers(conn)
    for model in ("tiny", tiny_model):
        assert _batch_for(strict, model).status == "in_progress"
    assert _model_not_found(_batch_for(strict, UNSERVED))  # never served: still refused
    batch = _batch_for(strict, "tiny")
    time.sleep(1.0)
    assert strict.batches.retrieve(batch.id).status == "in_progress"
    back = Worker(valkey_url, tiny_model, log=tmp_path / "back.log")
    try:
        done = wait_final(strict, batch.id, timeout=120)
        assert done.status == "completed" and done.request_counts.completed == 3
    finally:
        back.stop()


def test_a_worker_is_seen_before_its_model_loads(conn, valkey_url, tiny_model, tmp_path):
    """By the time RQ lists the worker (it listens for jobs), the API accepts its model."""
    worker = Worker(valkey_url, tiny_model, log=tmp_path / "w.log")
    try:
        deadline = time.monotonic() + 120
        while not RQWorker.all_keys(connection=conn):
            assert worker.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        assert unserved_problem(conn, "tiny") is None
        assert unserved_problem(conn, tiny_model) is None
    finally:
        worker.stop()


def test_a_batch_for_an_expected_model_waits_for_its_first_worker(
    valkey_url, conn, tiny_model, tmp_path
):
    """`mlxq api --models tiny`: listed and accepted before any worker ever ran it (its
    status `expected`); run once one does, then listed `live`."""
    server, thread, port = serve(
        valkey_url, sweep_interval=0.2, allow_unserved_models=False, expected_models=["tiny"]
    )
    try:
        client = api_client(port)
        listed = [(m.id, m.model_extra["status"]) for m in client.models.list().data]
        assert listed == [("tiny", "expected")]
        expected = client.models.retrieve("tiny").model_extra
        assert expected == {"source": "tiny", "status": "expected"}
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(UNSERVED)
        batch = _batch_for(client, "tiny")
        assert batch.status == "in_progress"
        assert _model_not_found(_batch_for(client, UNSERVED))
        worker = Worker(valkey_url, tiny_model, log=tmp_path / "w.log")
        try:
            done = wait_final(client, batch.id, timeout=120)
            assert done.status == "completed" and done.request_counts.completed == 3
            assert [m.model_extra["status"] for m in client.models.list().data] == ["live"]
        finally:
            worker.stop()
    finally:
        server.should_exit = True
        thread.join(10)


def test_models_lists_every_model_by_the_name_lines_use_live_then_asleep(strict, conn):
    """A worker of two models lists both; ids are the names that route (a GGUF file's
    name without `.gguf`, a hub id's last part), the full source beside; models served
    lately that no live worker serves are listed asleep, and each id answers."""
    now = time.time()
    info = worker_record(
        name="w1",
        model="/data/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        models=["/data/models/SmolLM2-135M-Instruct.Q4_1.gguf", "mlx-community/Qwen3-4B-4bit"],
        queues=["SmolLM2-135M-Instruct.Q4_1", "Qwen3-4B-4bit", "default"],
        started_at=now - 60,
        heartbeat_at=now,
    )
    conn.set(keys.worker_info("w1"), msgspec.json.encode(info))
    conn.sadd(keys.workers(), "w1")
    fleet.announce(conn, info.models, info.queues)
    fleet.announce(conn, ["/Users/me/models/Llama-3.2-1B"], ["Llama-3.2-1B", "default"])
    models = strict.models.list().data
    rows = [(m.id, m.model_extra["source"], m.model_extra["status"]) for m in models]
    assert rows == [
        ("Qwen3-4B-4bit", "mlx-community/Qwen3-4B-4bit", "live"),
        ("SmolLM2-135M-Instruct.Q4_1", "/data/models/SmolLM2-135M-Instruct.Q4_1.gguf", "live"),
        ("Llama-3.2-1B", "/Users/me/models/Llama-3.2-1B", "asleep"),
    ]
    assert all(m.object == "model" and m.owned_by == "mlxq" for m in models)
    assert models[0].created == int(now - 60)
    for m in models:
        got = strict.models.retrieve(m.id)
        assert (got.id, got.model_extra["source"]) == (m.id, m.model_extra["source"])
        assert got.model_extra["status"] == m.model_extra["status"]
    second = strict.models.retrieve("mlx-community/Qwen3-4B-4bit")  # the second, by source
    assert second.model_extra == {"source": "mlx-community/Qwen3-4B-4bit", "status": "live"}
    with pytest.raises(openai.NotFoundError):
        strict.models.retrieve("Qwen3-8B-4bit")


def test_responses_calls_outside_batches_say_how_to_batch_them(strict):
    with pytest.raises(openai.NotFoundError) as e:
        strict.responses.create(model="m", input="Hi")
    assert e.value.body["code"] == "unsupported_endpoint"
    assert 'create a batch with endpoint "/v1/responses"' in e.value.body["message"]
    with pytest.raises(openai.NotFoundError, match="in batches only"):
        strict.responses.retrieve("resp_123")


def test_an_api_batch_goes_where_its_models_worker_listens(
    strict, conn, valkey_url, tiny_model, tmp_path
):
    """A worker of the model on a queue of its own choosing (`-q evals`): the batch naming
    the model by the name /v1/models gives goes there, and completes."""
    worker = Worker(valkey_url, tiny_model, "-q", "evals", log=tmp_path / "w.log")
    try:
        worker.wait_listening(conn)
        (listed,) = [m.id for m in strict.models.list()]
        batch = _batch_for(strict, listed)
        assert batch.status == "in_progress" and waiting(conn, "tiny") == 0
        done = wait_final(strict, batch.id, timeout=120)
        assert done.status == "completed" and done.request_counts.completed == 3
    finally:
        worker.stop()
