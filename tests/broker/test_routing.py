"""Routing a batch's lines to workers that serve their models: the plan from the workers'
published records (live ones, and the models seen lately), kept in the batch record so a
resumed submit routes the same; and, end to end, a worker on its own `-q` queue gets the
lines that name its model by its short name."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mlxq.broker import batches, fleet, keys, routing
from mlxq.broker.routing import Fleet
from mlxq.wire import BatchModel, Request, SeenModel
from tests.helpers import Worker, run_mlxq, waiting, worker_record


def publish(conn, name: str, models: list[str], queues: list[str]) -> None:
    """A live worker of ``models`` on ``queues``, as it publishes itself (which also records
    its models as seen)."""
    now = time.time()
    record = worker_record(
        name=name, model=models[0], models=models if len(models) > 1 else [], queues=queues,
        started_at=now, heartbeat_at=now,
    )  # fmt: skip
    fleet.publish(conn, record, ttl=60)


def gone(conn, name: str) -> None:
    """The worker stops (its record goes; its models stay seen)."""
    fleet.remove(conn, name)


def routes(requests: list[Request], conn, queue: str | None = None, model: str | None = None):
    """``{line's model: queue}`` as `mlxq submit` plans them, and the batch's queue."""
    workers = Fleet.read(conn)
    batch = queue or routing.batch_queue(model, workers)
    plan = routing.plan(requests, batch, model, fleet=workers, given=queue is not None)
    return {m.model: m.queue for m in plan}, batch


def lines(*models: str | None) -> list[Request]:
    return [Request(prompt=f"p{i}", model=m) for i, m in enumerate(models)]


def test_a_line_goes_to_the_queue_its_models_worker_listens_on(conn):
    """The user's shape: `mlxq worker --model /models/tiny -q evals`; lines naming `tiny`
    (what `models.list()` gives) go to `evals`, given as --queue or not."""
    publish(conn, "w1", ["/models/tiny"], ["evals"])
    assert routes(lines("tiny", "tiny"), conn, queue="evals") == ({"tiny": "evals"}, "evals")
    assert routes(lines("tiny"), conn) == ({"tiny": "evals"}, "default")
    # --model too: the batch's own queue is where its workers listen
    both = {None: "evals", "tiny": "evals"}
    assert routes(lines(None, "tiny"), conn, model="org/tiny") == (both, "evals")


def test_a_queue_shared_by_two_models_takes_neither_models_lines(conn):
    """Workers of A and B both on `default`: a worker of B would refuse a line naming A, so
    A's lines go to A's own queue, even with `--queue default`; a queue only A's workers
    serve is taken when given."""
    publish(conn, "wa", ["org/A"], ["A", "default"])
    publish(conn, "wb", ["org/B"], ["B", "default"])
    reqs = lines("A", "org/B", None)
    assert routes(reqs, conn)[0] == {"A": "A", "org/B": "B", None: "default"}
    assert routes(reqs, conn, queue="default")[0] == {"A": "A", "org/B": "B", None: "default"}
    publish(conn, "wa2", ["/models/A"], ["fast"])
    assert routes(reqs, conn, queue="fast")[0] == {"A": "fast", "org/B": "B", None: "fast"}


def test_the_batchs_queue_comes_first_then_the_models_own_then_its_workers_others(conn):
    publish(conn, "w1", ["org/A"], ["mine", "A", "default"])
    reqs = lines("A")
    assert routes(reqs, conn, queue="mine")[0] == {"A": "mine"}
    assert routes(reqs, conn)[0] == {"A": "A"}  # no --queue: the model's own queue
    assert routes(reqs, conn, queue="nobodys")[0] == {"A": "A"}
    gone(conn, "w1")
    publish(conn, "w2", ["org/A"], ["other"])
    assert routes(reqs, conn, queue="nobodys")[0] == {"A": "other"}


def test_live_workers_before_those_seen_lately_and_the_own_queue_last(conn):
    """A model seen lately (its worker asleep) routes to its worker's queue; a live worker
    of it wins over that record; a model nobody served goes to its own queue."""
    publish(conn, "sleepy", ["org/A"], ["laptops"])
    gone(conn, "sleepy")
    assert routes(lines("A", "Z"), conn)[0] == {"A": "laptops", "Z": "Z"}
    publish(conn, "awake", ["org/A"], ["desk"])
    assert routes(lines("A"), conn)[0] == {"A": "desk"}


def test_a_live_queue_wins_over_a_stale_record_of_another_model_on_it(conn):
    """B served `evals` last week; now A's worker listens there alone: A's lines go there
    (not to A's own queue, where nobody listens)."""
    publish(conn, "old", ["org/B"], ["evals"])
    gone(conn, "old")
    publish(conn, "new", ["org/A"], ["evals"])
    assert routes(lines("A"), conn, queue="evals")[0] == {"A": "evals"}
    assert routes(lines("A"), conn)[0] == {"A": "evals"}


def test_an_adapters_queue_takes_its_models_lines_only_when_given(conn):
    """`mlxq worker --model org/A --adapter-path X -q a-lora`: lines naming A go there only
    with `--queue a-lora`, never found on their own (the adapter is not the model)."""
    now = time.time()
    record = worker_record(
        name="lora", model="org/A", queues=["a-lora"], adapter_path="/adapters/x",
        started_at=now, heartbeat_at=now,
    )  # fmt: skip
    fleet.publish(conn, record, ttl=60)
    assert routes(lines("A"), conn)[0] == {"A": "A"}
    assert routes(lines("A"), conn, queue="a-lora")[0] == {"A": "a-lora"}
    fleet.remove(conn, "lora")  # stopped: what remains is its seen record, adapter and all
    assert [(s.model, s.adapter) for s in fleet.seen_models(conn)] == [("org/A", "/adapters/x")]
    assert routes(lines("A"), conn)[0] == {"A": "A"}
    fleet.announce(conn, ["org/A"], ["A"])  # a plain worker of A: recorded apart from it
    assert {s.adapter for s in fleet.seen_models(conn)} == {None, "/adapters/x"}


def test_a_worker_of_several_models_gets_each_models_lines_on_its_own_queue(conn):
    publish(conn, "multi", ["org/A", "org/B"], ["A", "B", "default"])
    reqs = lines(None, "B")
    assert routes(reqs, conn, model="org/A") == ({None: "A", "B": "B"}, "A")
    # lines naming none on `default` there run on whichever model is loaded
    (part, runs), *_ = routing.mixed(routing.plan(reqs, "default", None), Fleet.read(conn))
    assert (part.model, part.queue, runs) == (None, "default", ["org/A", "org/B"])


def test_the_fleet_records_decide_what_is_unserved_and_what_mixes():
    now = time.time()
    workers = Fleet.of(
        [worker_record(name="a", model="org/A", queues=["A", "default"])],
        [SeenModel("org/A", ["A", "default"], now), SeenModel("org/B", ["B", "default"], now)],
    )
    plan = [BatchModel("default", 2), BatchModel("B", 1, "B"), BatchModel("C", 1, "C")]
    assert [m.model for m in routing.unserved(plan, workers)] == ["B", "C"]
    assert [m.model for m in routing.unserved(plan, workers, live=None)] == ["C"]
    assert routing.mixed(plan, workers) == [(plan[0], ["org/A", "org/B"])]
    nope = [BatchModel("Llama-nope", 3)]  # `--model org/Llama-nope`: unserved too
    assert routing.unserved(nope, workers, "org/Llama-nope") == nope
    assert routing.describe(nope, "org/Llama-nope") == (
        "3 lines naming no model, for --model 'org/Llama-nope' (queue 'Llama-nope')"
    )


def test_a_resumed_submit_routes_the_rest_by_the_stored_plan(conn, monkeypatch):
    """The plan is made once, from the workers at the first submit; a resume after the
    workers changed routes the rest as the first part."""
    from mlxq.broker import submission
    from mlxq.broker.rq_store import whereabouts

    def die(_ids: list[str]) -> None:
        raise RuntimeError("cut")

    publish(conn, "w1", ["org/A"], ["evals"])
    reqs = lines(*(["A", None] * 3))
    workers = Fleet.read(conn)
    plan = routing.plan(reqs, "base", None, fleet=workers, given=True)
    monkeypatch.setattr(submission, "CHUNK", 4)
    with pytest.raises(RuntimeError):
        batches.submit(conn, reqs, queue="base", models=plan, on_jobs=die)
    gone(conn, "w1")
    publish(conn, "w2", ["org/A"], ["A"])
    (batch_id,) = [b.decode() for b in conn.zrange(keys.batches(), 0, -1)]
    batches.resume(conn, batch_id, reqs)
    assert batches.get_batch(conn, batch_id).models == [
        BatchModel(queue="evals", lines=3, model="A"),
        BatchModel(queue="base", lines=3),
    ]
    origins = whereabouts.origins(conn, batches.batch_job_ids(conn, batch_id))
    assert origins == ["evals", "base"] * 3
    assert (waiting(conn, "evals"), waiting(conn, "A")) == (3, 0)


def test_a_plan_for_other_requests_is_refused(conn):
    with pytest.raises(ValueError, match="2 lines for 3 requests"):
        batches.submit(conn, lines(None, None, None), models=[BatchModel("default", 2)])


# -- end to end --------------------------------------------------------------------------


@pytest.mark.slow
def test_openai_lines_naming_the_model_by_its_short_name_run_on_its_q_worker(
    conn, valkey_url, tiny_model, tmp_path
):
    """`mlxq worker --model TINY -q evals`, then `mlxq submit file --queue evals --wait`
    whose OpenAI lines say `body.model: tiny` (its short name): every line completes, no
    warning; without --queue too (the only queue its workers serve)."""
    short = Path(tiny_model).name
    rows = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": short, "max_tokens": 3,
                  "messages": [{"role": "user", "content": f"Hi {i}"}]}}
        for i in range(5)
    ]  # fmt: skip
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    worker = Worker(valkey_url, tiny_model, "-q", "evals", log=tmp_path / "w.log")
    try:
        worker.wait_listening(conn)
        for queue in (["--queue", "evals"], []):
            out = tmp_path / f"out{len(queue)}.jsonl"
            args = ("submit", str(src), *queue, "--wait", "--timeout", "120", "-o", str(out))
            done = run_mlxq(*args, url=valkey_url)
            assert done.returncode == 0, done.stderr + worker.log.read_text()
            assert "warning" not in done.stderr and "note:" not in done.stderr, done.stderr
            assert "enqueueing 5 requests to queue 'evals'" in done.stderr, done.stderr
            assert "submitted 5 requests to queue 'evals'" in done.stdout, done.stdout
            results = [json.loads(x) for x in out.read_text().splitlines()]
            assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(5)]
            assert all(r["finish_reason"] == "length" for r in results), results
            assert {r["model"] for r in results} == {tiny_model}
    finally:
        worker.stop()
