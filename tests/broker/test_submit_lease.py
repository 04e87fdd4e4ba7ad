"""A submit writes only while it holds its lease: one paused past its lease while a
``--resume`` took over stops with one line, and the batch holds every line exactly once."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import redis

from mlxq.broker import batches, keys, submission
from mlxq.broker.rq_store import reads
from mlxq.wire import Request
from tests.helpers import run_mlxq, start_submit

N = 3 * batches.CHUNK + 5


def _requests(n: int = N) -> list[Request]:
    return [Request(prompt=f"p{i}", custom_id=f"c{i}") for i in range(n)]


def _assert_each_line_once(conn: redis.Redis, batch_id: str, n: int) -> None:
    ids = batches.batch_job_ids(conn, batch_id)
    assert len(ids) == len(set(ids)) == n
    metas = reads.job_metas(conn, ids)
    assert [m.index for m in metas] == list(range(n))
    assert batches.batch_status(conn, batch_id).queued == n


def _batch_of(conn: redis.Redis, ids: list[str]) -> str:
    return reads.job_metas(conn, ids[:1])[0].batch_id


def test_a_submit_whose_lease_was_taken_over_stops_before_its_next_chunk(conn):
    reqs, resumed = _requests(), []

    def after_chunk(ids: list[str]) -> None:
        if resumed:
            return
        # The submit "paused" past its lease: the lease lapses, a resume takes over and ends.
        batch_id = _batch_of(conn, ids)
        conn.delete(keys.batch_submitter(batch_id))
        resumed.append((batch_id, *batches.resume(conn, batch_id, reqs)))

    with pytest.raises(submission.LeaseLost, match="another submit took over") as e:
        batches.submit(conn, reqs, on_jobs=after_chunk)
    assert "stopped at line 1001 without enqueueing anything twice" in str(e.value)
    ((batch_id, info, before),) = resumed
    assert before == batches.CHUNK and info.state == "submitted"
    _assert_each_line_once(conn, batch_id, N)


def test_a_lease_taken_but_not_yet_used_stops_the_old_submit_too(conn):
    reqs, ids_seen = _requests(), []

    def after_chunk(ids: list[str]) -> None:
        ids_seen.append(ids)
        batch_id = _batch_of(conn, ids)
        conn.set(keys.batch_submitter(batch_id), "pid 1 on elsewhere lease 0123")

    with pytest.raises(submission.LeaseLost, match=r"another submit \(pid 1 on elsewhere\)"):
        batches.submit(conn, reqs, on_jobs=after_chunk)
    batch_id = _batch_of(conn, ids_seen[0])
    assert len(ids_seen) == 1 and conn.llen(keys.batch_jobs(batch_id)) == batches.CHUNK
    # The other submit's lease is not ours to delete.
    assert conn.get(keys.batch_submitter(batch_id)) == b"pid 1 on elsewhere lease 0123"


def test_a_lapsed_lease_nobody_took_lets_the_submit_go_on(conn):
    reqs = _requests()

    def after_chunk(ids: list[str]) -> None:
        conn.delete(keys.batch_submitter(_batch_of(conn, ids)))  # asleep past 30 s, nobody resumed

    info = batches.submit(conn, reqs, on_jobs=after_chunk)
    assert info.state == "submitted"
    _assert_each_line_once(conn, info.batch_id, N)
    assert not conn.exists(keys.batch_submitter(info.batch_id))


@pytest.mark.slow
def test_a_submit_stopped_with_sigstop_while_resume_ran_enqueues_nothing_twice(
    valkey_url, conn, tmp_path: Path
):
    n = 20_000
    path = tmp_path / "big.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "custom_id": f"c{i}"}) + "\n" for i in range(n))
    )
    proc, batch_id = start_submit(valkey_url, path, "big")
    try:
        while conn.llen(keys.batch_jobs(batch_id)) == 0:
            time.sleep(0.01)  # until its first chunk is in
        proc.send_signal(signal.SIGSTOP)  # Ctrl-Z
        stopped_at = conn.llen(keys.batch_jobs(batch_id))
        assert 0 < stopped_at < n
        conn.delete(keys.batch_submitter(batch_id))  # its 30 s lease lapsing
        done = run_mlxq("submit", str(path), "--resume", batch_id, url=valkey_url)
        assert done.returncode == 0, done.stderr
        proc.send_signal(signal.SIGCONT)  # fg
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if "mlxq: error:" in line]
    assert len(lines) == 1 and "another submit" in lines[0] and "took over" in lines[0], err
    assert "Traceback" not in err
    _assert_each_line_once(conn, batch_id, n)
