"""The read-only commands on a Redis that is full (``noeviction`` at ``maxmemory``, set for
real on the test server and restored): ``mlxq status`` (a batch, with jobs that nothing holds,
and the queue overview), ``results``, ``workers`` and ``tail`` answer as usual and make Redis
run no write and no transaction (Redis 7 refuses every command queued in a MULTI while full,
reads too); a command refused a write says so in one line with the fix."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import redis
from helpers import dequeued, run_mlxq, worker_record
from rq.job import Job

from mlxq.broker import batches, fleet, streams
from mlxq.broker.intake import register
from mlxq.broker.rq_store import transitions
from mlxq.broker.serializer import serializer
from mlxq.cli.support import redis_errors
from mlxq.wire import Request, Result, StreamChunk, Timing, Usage

SETTINGS = ("maxmemory", "maxmemory-policy")


@pytest.fixture
def server(conn: redis.Redis, valkey_url: str) -> Iterator[redis.Redis]:
    """A second client on the test server, its memory settings put back afterwards."""
    before = {k: conn.config_get(k)[k] for k in SETTINGS}
    admin = redis.Redis.from_url(valkey_url)
    yield admin
    admin.config_set("maxmemory", 0)
    for key, value in before.items():
        admin.config_set(key, value)
    admin.close()


def _fill(server: redis.Redis) -> None:
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", 1)
    with pytest.raises(redis.OutOfMemoryError):
        server.set("mlxq:test:room", 1)


def _finished_batch(conn: redis.Redis) -> str:
    """A batch of two requests, both ended as a worker ends them."""
    batch = batches.submit(conn, [Request(prompt=f"p{i}", custom_id=f"c{i}") for i in range(2)])
    ids = batches.batch_job_ids(conn, batch.batch_id)
    with conn.pipeline() as pipe:
        for job in Job.fetch_many(ids, connection=conn, serializer=serializer):
            result = Result(
                job_id=job.id,
                custom_id=job.meta.get("custom_id"),
                finish_reason="stop",
                text="done",
                token_ids=[1],
                usage=Usage(1, 1, 2),
                model="m",
                worker="w",
                batch_id=batch.batch_id,
                index=job.meta.get("index"),
                timing=Timing(started_at=time.time(), finished_at=time.time()),
            )
            transitions.end_job(pipe, job, batches.make_queue(conn, job.origin), result)
        pipe.execute()
    return batch.batch_id


def _write_commands(conn: redis.Redis, ran: dict[str, int]) -> list[str]:
    """Of the commands in ``ran``, those that write or that Redis refuses when full."""
    names = [name.removeprefix("cmdstat_") for name in ran]
    info = conn.execute_command("COMMAND", "INFO", *names)
    bad = {"write", "denyoom"}
    return [n for n in names if n in ("multi", "exec") or bad & set(info[n]["flags"])]


def test_read_only_commands_answer_on_a_full_redis_and_write_nothing(
    conn, server, valkey_url, tmp_path
):
    done = _finished_batch(conn)
    running, worker, group = dequeued(conn, 3, "full")  # three pulled,
    register(worker, group[:1])  # one of them started,
    lost = group[2][0].id
    conn.lrem(group[2][1].intermediate_queue_key, 1, lost)  # and one lost
    fleet.publish(conn, worker_record(name="w1", queues=["full"], heartbeat_at=time.time()), 60)
    streams.publish(conn, [StreamChunk(group[0][0].id, "Hello", [1])], [(group[0][0].id, "stop")])
    _fill(server)
    before = {k: v["calls"] for k, v in conn.info("commandstats").items()}

    out = {}
    for name, args in {
        "status": ("status", running, "--json"),
        "status-text": ("status", running),
        "overview": ("status", "--json"),
        "results": ("results", done, "-o", str(tmp_path / "out.jsonl")),
        "workers": ("workers", "--json"),
        "tail": ("tail", group[0][0].id),
    }.items():
        proc = run_mlxq(*args, url=valkey_url)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (name, proc.stderr)
        out[name] = proc.stdout

    after = {k: v["calls"] for k, v in conn.info("commandstats").items()}
    ran = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert _write_commands(conn, ran) == [], ran
    counts = json.loads(out["status"])
    assert (counts["queued"], counts["started"], counts["unaccounted"]) == (2, 1, [lost])
    assert "1 jobs wait or run by their status" in out["status-text"]
    assert {row["name"]: row["started"] for row in json.loads(out["overview"])}["full"] == 1
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    assert [w["name"] for w in json.loads(out["workers"])] == ["w1"]
    assert out["tail"] == "Hello\n"


def test_a_refused_write_is_one_line_with_the_fix(conn, server, valkey_url, capsys):
    _fill(server)
    with pytest.raises(SystemExit) as exited, redis_errors(valkey_url):
        conn.set("mlxq:test:key", 1)
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("mlxq: error: Redis is full (maxmemory reached, noeviction)"), err
    assert "CONFIG SET maxmemory" in err and "mlxq results" in err, err
