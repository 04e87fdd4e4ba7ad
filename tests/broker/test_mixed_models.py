"""One file, many models: each line goes to its model's queue, a batch's status counts each
model, results come back in input order across models, and lines for a model nobody serves
are named at submit."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxq.broker import batches, fleet, keys, unaccounted
from mlxq.wire import BatchModel, Request
from tests.helpers import Worker, run_mlxq, waiting


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def mixed_lines(a: str, b: str) -> list[dict]:
    """Lines for models ``a`` and ``b`` interleaved, an OpenAI one and one naming none."""
    return [
        {"custom_id": "c0", "prompt": "Once", "max_tokens": 3, "model": a},
        {"custom_id": "c1", "prompt": "Upon", "max_tokens": 4, "model": b},
        {"custom_id": "c2", "prompt": "A time", "max_tokens": 2},
        {"custom_id": "c3", "method": "POST", "url": "/v1/completions",
         "body": {"model": b, "prompt": "There", "max_tokens": 5}},
        {"custom_id": "c4", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
         "model": a},
    ]  # fmt: skip


def own_queue(model: str) -> str:
    return keys.queue_name_for_model(model)


def test_each_line_goes_to_its_models_queue(conn, valkey_url, tmp_path):
    src = write_lines(tmp_path / "mixed.jsonl", mixed_lines("org/Alpha", "/models/Beta.gguf"))
    out = run_mlxq("submit", str(src), "--json", url=valkey_url)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["queue"] == "default"  # the lines that name no model
    assert info["models"] == [
        {"queue": "Alpha", "lines": 2, "model": "org/Alpha"},
        {"queue": "Beta", "lines": 2, "model": "/models/Beta.gguf"},
        {"queue": "default", "lines": 1},
    ]
    assert [waiting(conn, n) for n in ("Alpha", "Beta", "default")] == [2, 2, 1]
    status = run_mlxq("status", info["batch_id"], "--json", url=valkey_url)
    counts = json.loads(status.stdout)
    assert (counts["total"], counts["queued"]) == (5, 5)
    per_model = {
        m["queue"]: (m["models"], m["total"], m["counts"]["queued"]) for m in counts["models"]
    }
    assert per_model == {
        "Alpha": (["org/Alpha"], 2, 2),
        "Beta": (["/models/Beta.gguf"], 2, 2),
        "default": (["(none)"], 1, 1),
    }
    human = run_mlxq("status", info["batch_id"], url=valkey_url).stdout
    assert "  org/Alpha (queue Alpha): 0/2 done — 2 queued" in human, human


def test_explicit_queue_takes_the_lines_naming_no_model_or_the_batchs_model(
    conn, valkey_url, tmp_path
):
    """`--queue fast --model org/Alpha`: lines naming no model and lines naming Alpha (a
    local folder of it too: the same queue name) go to `fast`; Beta's go to Beta's queue."""
    lines = mixed_lines("/local/Alpha", "Beta")
    src = write_lines(tmp_path / "mixed.jsonl", lines)
    args = ("submit", str(src), "--queue", "fast", "--model", "org/Alpha", "--json")
    out = run_mlxq(*args, url=valkey_url)
    assert out.returncode == 0, out.stderr
    assert [waiting(conn, n) for n in ("fast", "Beta", "Alpha")] == [3, 2, 0]
    assert "2 lines for model 'Beta' (queue 'Beta')" in out.stderr, out.stderr


def test_lines_for_a_model_nobody_serves_are_named_or_refused(conn, valkey_url, tmp_path):
    src = write_lines(tmp_path / "mixed.jsonl", mixed_lines("Alpha", "Beta"))
    warned = run_mlxq("submit", str(src), url=valkey_url)
    assert warned.returncode == 0, warned.stderr
    assert "no live worker serves 2 lines for model 'Alpha' (queue 'Alpha'), 2 lines for " in (
        warned.stderr
    ), warned.stderr
    conn.flushall()
    refused = run_mlxq("submit", str(src), "--require-workers", url=valkey_url)
    assert refused.returncode != 0
    assert "1 line naming no model (queue 'default')" in refused.stderr, refused.stderr
    assert "nothing was enqueued" in refused.stderr
    assert conn.zcard(keys.batches()) == 0 and waiting(conn, "Alpha") == 0


def test_the_dashboard_rows_a_mixed_batch_with_each_models_counts(conn):
    from mlxq.api.dashboard_rows import batch_row

    reqs = [Request(prompt=f"p{i}", model="Beta" if i % 2 else None) for i in range(3)]
    info = batches.submit(conn, reqs, queue="alpha", model="org/alpha")
    row = batch_row(info, batches.batch_status(conn, info.batch_id), time.time(), None, None)
    assert [(m.queue, m.models, m.total, m.counts["queued"]) for m in row.models] == [
        ("alpha", ["org/alpha"], 2, 2),
        ("Beta", ["Beta"], 1, 1),
    ]
    plain = batches.submit(conn, reqs[:1], queue="alpha")  # one model: no rows per model
    assert batch_row(plain, batches.batch_status(conn, plain.batch_id), 0, None, None).models == []


def test_a_sweep_of_one_queue_leaves_the_batchs_jobs_on_its_other_queues(conn):
    reqs = [Request(prompt=f"p{i}", model="Beta" if i % 2 else None) for i in range(4)]
    batch = batches.submit(conn, reqs, queue="alpha").batch_id
    for _ in range(2):  # (the first sweep would mark them, the second put them back)
        assert unaccounted.sweep(conn, ["alpha"], 0, every_s=5) == []
        conn.delete(keys.audit_lock())
    assert unaccounted.find(conn, batch) == []
    assert (waiting(conn, "alpha"), waiting(conn, "Beta")) == (2, 2)


def test_a_resumed_submit_routes_the_rest_as_the_first_part(conn, monkeypatch):
    from mlxq.broker import submission
    from mlxq.broker.rq_store import whereabouts

    class Cut(Exception):
        """The submit dies after its first chunk."""

    def die(_ids: list[str]) -> None:
        raise Cut

    monkeypatch.setattr(submission, "CHUNK", 4)
    reqs = [Request(prompt=f"p{i}", model=("A", "B", None)[i % 3]) for i in range(7)]
    with pytest.raises(Cut):
        batches.submit(conn, reqs, queue="base", on_jobs=die)
    (batch_id,) = [b.decode() for b in conn.zrange(keys.batches(), 0, -1)]
    _, before = batches.resume(conn, batch_id, reqs)
    assert before == 4
    assert batches.get_batch(conn, batch_id).models == [
        BatchModel(queue="A", lines=3, model="A"),
        BatchModel(queue="B", lines=2, model="B"),
        BatchModel(queue="base", lines=2),
    ]
    ids = batches.batch_job_ids(conn, batch_id)
    assert whereabouts.origins(conn, ids) == ["A", "B", "base", "A", "B", "base", "A"]
    assert (waiting(conn, "A"), waiting(conn, "B"), waiting(conn, "base")) == (3, 2, 2)


def test_require_workers_holds_on_resume_too(conn, valkey_url, tmp_path, monkeypatch):
    """`--resume BATCH --require-workers` checks the queues the first part planned: refused
    (nothing more enqueued) while no worker serves them; without the flag, a warning."""
    from mlxq.broker import submission

    def die(_ids: list[str]) -> None:
        raise RuntimeError("cut")

    lines = [{"custom_id": f"c{i}", "prompt": f"p{i}", "model": "Alpha"} for i in range(6)]
    src = write_lines(tmp_path / "alpha.jsonl", lines)
    monkeypatch.setattr(submission, "CHUNK", 4)
    reqs = [Request(prompt=f"p{i}", custom_id=f"c{i}", model="Alpha") for i in range(6)]
    with pytest.raises(RuntimeError):
        batches.submit(conn, reqs, queue="default", on_jobs=die, source=str(src))
    (batch_id,) = [b.decode() for b in conn.zrange(keys.batches(), 0, -1)]
    args = ("submit", str(src), "--resume", batch_id)
    refused = run_mlxq(*args, "--require-workers", url=valkey_url)
    assert refused.returncode != 0
    assert "no live worker serves 6 lines for model 'Alpha'" in refused.stderr, refused.stderr
    assert waiting(conn, "Alpha") == 4
    warned = run_mlxq(*args, url=valkey_url)
    assert warned.returncode == 0, warned.stderr
    assert "warning: no live worker serves 6 lines for model 'Alpha'" in warned.stderr
    assert waiting(conn, "Alpha") == 6


# -- real workers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A second tiny model (other random weights), so two workers serve two models."""
    from mlxq.engine.models.make import make_model

    return str(make_model(tmp_path_factory.mktemp("models") / "tinyb", "tiny", seed=1))


@pytest.fixture
def two_workers(valkey_url, conn, tiny_model, other_model, tmp_path) -> Iterator[None]:
    """Two long-lived workers, one per model, on their models' queues (and default for the
    first), started before any job."""
    workers = [
        Worker(valkey_url, tiny_model, log=tmp_path / "a.log"),
        Worker(valkey_url, other_model, "-q", own_queue(other_model), log=tmp_path / "b.log"),
    ]
    deadline = time.monotonic() + 120
    while len(fleet.live_workers(conn)) < 2:
        for w in workers:
            assert w.proc.poll() is None, w.log.read_text()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    yield
    for w in workers:
        w.stop()


@pytest.mark.slow
def test_a_mixed_file_runs_on_two_workers_results_in_input_order(
    two_workers, conn, valkey_url, tiny_model, other_model, tmp_path
):
    three = [line for _ in range(3) for line in mixed_lines(tiny_model, other_model)]
    lines = [{**line, "custom_id": f"c{i}"} for i, line in enumerate(three)]
    src = write_lines(tmp_path / "mixed.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = ("submit", str(src), "--wait", "--timeout", "120", "-o", str(out), "--require-workers")
    done = run_mlxq(*args, url=valkey_url)
    assert done.returncode == 0, done.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(15)]
    # each line ran on its model (lines naming none: on `default`, the first worker's)
    wanted = [(line.get("model") or line.get("body", {}).get("model")) for line in lines]
    assert [r["model"] for r in results] == [w or tiny_model for w in wanted]
    status = json.loads(run_mlxq("status", results[0]["batch_id"], "--json", url=valkey_url).stdout)
    finished = {m["queue"]: (m["total"], m["counts"]["finished"]) for m in status["models"]}
    assert finished == {
        own_queue(tiny_model): (6, 6),
        own_queue(other_model): (6, 6),
        "default": (3, 3),
    }
    assert status["finished"] == 15


@pytest.mark.slow
@pytest.mark.parametrize("given", [True, False])
def test_mlxq_run_serves_a_files_models_one_after_another(tmp_path, tiny_model, other_model, given):
    """`mlxq run` with lines for two models: one after another, results in input order;
    --model is the model of the lines naming none (without it: the first one named)."""
    src = write_lines(tmp_path / "mixed.jsonl", mixed_lines(other_model, tiny_model))
    env = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}
    out = tmp_path / "out.jsonl"
    args = ["run", str(src), "-o", str(out), "--json", "--data-dir", str(tmp_path / "data")]
    done = run_mlxq(*args, *(["--model", tiny_model] if given else []), env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["finished"] == 5
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(5)]
    unnamed = tiny_model if given else other_model  # c2 names no model
    models = [other_model, tiny_model, unnamed, tiny_model, other_model]
    assert [r["model"] for r in results] == models
    loads = [line.split("loading ")[-1] for line in done.stderr.splitlines() if "loading" in line]
    assert loads == [other_model, tiny_model], done.stderr  # in order of first appearance


def test_run_loads_the_command_lines_spelling_of_a_model_lines_name_otherwise(tmp_path):
    """Lines naming `tiny` run on `--model models/tiny` (one model, one queue name); a
    model only lines name that cannot be found fails naming those lines and the way out."""
    from mlxq.cli.run_models import models_to_serve, named_by

    reqs = [Request(prompt="a", model="tiny"), Request(prompt="b"), Request(prompt="c", model="x")]
    assert models_to_serve(reqs, "/m/tiny") == ["/m/tiny", "x"]
    assert named_by(reqs, "x") == "1 request names model 'x' (the first: request 3)"
    assert named_by(reqs, "tiny").startswith("1 request names model 'tiny'")


@pytest.mark.slow
def test_run_refuses_a_placeholder_model_in_one_line_and_ignores_it_when_told(tmp_path, tiny_model):
    """An OpenAI file written for another service (body.model: gpt-4o-mini) through `mlxq
    run --model M`: refused before anything runs, naming the lines and the flag; with
    --ignore-line-models every line runs on M."""
    lines = [
        {"custom_id": f"o{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-4o-mini", "prompt": f"P{i}", "max_tokens": 3}}
        for i in range(3)
    ]  # fmt: skip
    src = write_lines(tmp_path / "openai.jsonl", lines)
    env = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}
    env["HF_HUB_OFFLINE"] = "1"
    out = tmp_path / "out.jsonl"
    args = ["run", str(src), "--model", tiny_model, "-o", str(out), "--data-dir", str(tmp_path)]
    refused = run_mlxq(*args, env=env)
    assert refused.returncode != 0 and not out.exists()
    (line,) = [x for x in refused.stderr.splitlines() if x.strip()]
    assert "3 requests name model 'gpt-4o-mini' (the first: request 1)" in line, line
    assert "pass --ignore-line-models" in line
    done = run_mlxq(*args, "--ignore-line-models", env=env)
    assert done.returncode == 0, done.stderr
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["custom_id"], r["model"]) for r in results] == [
        (f"o{i}", tiny_model) for i in range(3)
    ]
