"""``mlxq status`` stays cheap whatever the batch's size: the same Redis commands for a
20,000-job batch as for a 10-job one (counted by the server, ``INFO commandstats``, never
timed), and a bounded number when some jobs are lost and it must read jobs one by one."""

from __future__ import annotations

import json

import pytest
import redis
from click.testing import CliRunner

from mlxq.broker import batches, keys, unaccounted
from mlxq.cli.status import status
from mlxq.wire import Request

BIG = 20_000


def _calls(conn: redis.Redis) -> dict[str, int]:
    """Commands the server has run so far, by name."""
    return {k: v["calls"] for k, v in conn.info("commandstats").items()}


def _status(conn: redis.Redis, url: str, batch_id: str) -> tuple[dict, dict[str, int]]:
    """``mlxq status BATCH --json`` in this process: its output, and the commands it made
    Redis run (the INFO that reads them counted out)."""
    before = _calls(conn)
    done = CliRunner().invoke(status, [batch_id, "--json", "--redis-url", url])
    after = _calls(conn)
    assert done.exit_code == 0, done.output
    ran = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    ran["cmdstat_info"] -= 1
    return json.loads(done.output), {k: n for k, n in ran.items() if n}


def _submit(conn: redis.Redis, n: int, queue: str) -> str:
    return batches.submit(conn, [Request(prompt=f"p{i}") for i in range(n)], queue=queue).batch_id


def test_status_runs_the_same_commands_for_any_batch_size(conn, valkey_url):
    small, big = _submit(conn, 10, "small"), _submit(conn, BIG, "big")
    out_small, ran_small = _status(conn, valkey_url, small)
    out_big, ran_big = _status(conn, valkey_url, big)
    assert (out_small["queued"], out_big["queued"]) == (10, BIG)
    assert "unaccounted" not in out_small and "unaccounted" not in out_big
    assert ran_big == ran_small, (ran_small, ran_big)
    assert sum(ran_big.values()) < 30, ran_big


def test_status_of_a_big_batch_with_lost_jobs_reads_a_bounded_number(conn, valkey_url, monkeypatch):
    """Lost jobs: status lists those among the first ``SCAN_LIMIT`` jobs, and says how many
    there are at least (from the counters) when it did not read them all."""
    monkeypatch.setattr(unaccounted, "SCAN_LIMIT", 2_000)
    batch = _submit(conn, BIG, "lost")
    ids = batches.batch_job_ids(conn, batch)
    early, late = ids[100], ids[15_000]
    for job_id in (early, late):
        conn.lrem(keys.lane("lost", batch), 1, job_id)
    out, ran = _status(conn, valkey_url, batch)
    assert out["unaccounted"] == [early]  # the late one is past what status reads
    assert (out["unaccounted_count"], out["unaccounted_exact"]) == (2, False)
    # Per job read: its status (and the queue of those no place holds), 2,000 of them.
    assert ran["cmdstat_hget"] <= 2_000 + 10, ran
    assert sum(ran.values()) < 2_000 + 60, ran
    human = CliRunner().invoke(status, [batch, "--redis-url", valkey_url]).output
    assert "at least 2 jobs wait or run by their status" in human, human
    assert "lists 1 of them" in human, human


@pytest.mark.parametrize("lost_at", [0, 9])
def test_status_lists_lost_jobs_exactly_in_a_batch_it_reads_whole(conn, valkey_url, lost_at):
    batch = _submit(conn, 10, "whole")
    lost = batches.batch_job_ids(conn, batch)[lost_at]
    conn.lrem(keys.lane("whole", batch), 1, lost)
    out, _ = _status(conn, valkey_url, batch)
    assert out["unaccounted"] == [lost]
    assert (out["unaccounted_count"], out["unaccounted_exact"]) == (1, True)
