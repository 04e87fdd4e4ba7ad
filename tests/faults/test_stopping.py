"""A stopping worker finishes what it generates and puts back, at once, what it had only
pulled: a long-lived worker on SIGTERM, then another worker that takes the rest."""

from __future__ import annotations

import re
import signal
import time

import pytest

from mlxq.broker import batches
from mlxq.broker.rq_store import rq_keys
from mlxq.wire import Request

pytestmark = pytest.mark.slow


def test_sigterm_puts_back_pulled_jobs_and_finishes_running_ones(start, conn):
    reqs = [Request(prompt=f"Story {i}:", max_tokens=1500, custom_id=f"c{i}") for i in range(6)]
    batch = batches.submit(conn, reqs, queue="stopq").batch_id
    a = start("-q", "stopq", "--max-batch", "1", "--prefill-batch", "2", "--name", "first")
    deadline = time.monotonic() + 120
    while batches.batch_status(conn, batch).started < 2:  # one generating, one or more pulled
        assert time.monotonic() < deadline and a.proc.poll() is None, a.log.read_text()
        time.sleep(0.05)
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(120) == 0
    log = a.log.read_text()
    put_back = set(re.findall(r"put job (\S+) back on stopq", log))
    assert put_back, log  # the pulled ones went back without being generated
    b = start("-q", "stopq", "--name", "second")
    status = batches.wait_for_batch(conn, batch, timeout=300)
    b.stop()
    assert (status.finished, status.queued, status.started) == (6, 0, 0), status
    ids = batches.batch_job_ids(conn, batch)
    assert [conn.xlen(rq_keys.results_key(j)) for j in ids] == [1] * 6
    by_worker = {r.job_id: r.worker for r in batches.iter_batch_results(conn, batch)}
    assert all(by_worker[j] == "second" for j in put_back), by_worker
    assert "first" in by_worker.values()  # what it was generating, it finished
