"""`mlxq dashboard`: the snapshot it serves, its key rules, and the page in a real browser.

The browser tests run Debian's headless Chromium against a real `mlxq worker` process
(tiny model), a real `mlxq dashboard` process and real batches, and read the rendered DOM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from browser import CHROMIUM, FLAGS
from helpers import ROOT, free_port, run_mlxq, wait_for_port
from test_fleet import make_info

from mlxq.api.dashboard_rows import STALL_AFTER_S
from mlxq.api.dashboard_state import Dashboard
from mlxq.broker import batches, fleet, keys
from mlxq.wire import Request

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)"
)


# -- helpers -------------------------------------------------------------------------------
class Rows(HTMLParser):
    """The rendered tables: {kind: {row id: {data-field: text}}} for rows with data-batch,
    data-worker or data-queue; and the attributes of elements by id."""

    KINDS = ("batch", "worker", "queue")

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, dict[str, str]]] = {k: {} for k in self.KINDS}
        self.by_id: dict[str, dict[str, str | None]] = {}
        self.body: dict[str, str | None] = {}
        self._row: dict[str, str] | None = None
        self._fields: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if "id" in a:
            self.by_id[a["id"]] = a
        if tag == "body":
            self.body = a
        if tag == "tr":
            self._row = None
            for kind in self.KINDS:
                if f"data-{kind}" in a:
                    self._row = self.rows[kind].setdefault(a[f"data-{kind}"], {})
        if self._row is not None and "data-field" in a:
            self._fields.append(a["data-field"])
            self._row.setdefault(a["data-field"], "")
        elif self._row is not None:  # text in a nested element belongs to the cell's field
            self._fields.append(self._fields[-1] if self._fields else "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None
        elif self._fields and tag in ("td", "span", "div", "ul", "li"):
            self._fields.pop()

    def handle_data(self, data: str) -> None:
        if self._row is not None and self._fields and self._fields[-1]:
            self._row[self._fields[-1]] += data


def render(url: str, tmp_path: Path, budget_ms: int = 5000) -> Rows:
    """The DOM of ``url`` after ``budget_ms`` of (virtual) time in headless Chromium."""
    cmd = [
        str(CHROMIUM),
        *FLAGS,
        f"--user-data-dir={tmp_path / 'chromium'}",
        f"--virtual-time-budget={budget_ms}",
        "--dump-dom",
        url,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert "<body" in proc.stdout, proc.stderr[-2000:]
    parsed = Rows()
    parsed.feed(proc.stdout)
    return parsed


def get(url: str, key: str | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def start_dashboard(url: str, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxq", "dashboard", "--port", str(port), *args],
        cwd=ROOT,
        env={**(env or os.environ), "MLXQ_REDIS_URL": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_port(port, proc, timeout=30)
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


WORKER = ("--name", "dash-w1", "--max-batch", "4")


def start_worker(tiny_model: str, env: dict) -> subprocess.Popen:
    """A real `mlxq worker` named dash-w1 (batch of 4) on queue `dash`."""
    return subprocess.Popen(
        [sys.executable, "-m", "mlxq", "worker", "--model", tiny_model, "-q", "dash", *WORKER],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# -- a live fleet: one real worker, a finished batch and a waiting one ---------------------------
@pytest.fixture
def live_fleet(valkey_url, conn, tiny_model) -> Iterator[dict]:
    env = {**os.environ, "MLXQ_REDIS_URL": valkey_url}
    worker = start_worker(tiny_model, env)
    try:
        reqs = [Request(prompt=f"count {i}", max_tokens=4, custom_id=f"d{i}") for i in range(3)]
        done = batches.submit(conn, reqs, queue="dash", source="done.jsonl")
        status = batches.wait_for_batch(conn, done.batch_id, timeout=180)
        assert status.finished == 3, status
        waiting = batches.submit(conn, reqs[:2], queue="nobody", source="waiting.csv")
        yield {"done": done.batch_id, "waiting": waiting.batch_id, "model": tiny_model, "env": env}
    finally:
        stop(worker)


def wait_idle(conn, name: str, timeout: float = 30.0) -> None:
    """Until the worker ``name`` publishes 0 tok/s: idle, it generates nothing now (its
    rate over the last minute is no longer what it says)."""
    deadline = time.monotonic() + timeout
    while True:
        (w,) = [w for w in fleet.live_workers(conn) if w.name == name]
        if w.in_flight == 0 and w.recent_tps == 0.0:
            return
        assert time.monotonic() < deadline, f"idle worker {name} still says {w.recent_tps} tok/s"
        time.sleep(0.5)


@needs_chromium
def test_the_page_shows_batches_workers_and_queues_in_a_real_browser(
    live_fleet, valkey_url, conn, tmp_path
):
    wait_idle(conn, "dash-w1")  # its batch ended moments ago
    proc, port = start_dashboard(valkey_url)
    try:
        dom = render(f"http://127.0.0.1:{port}/", tmp_path)
        status, _h, body = get(f"http://127.0.0.1:{port}/api/state")
    finally:
        stop(proc)
    # the page redrew itself more than once without a reload
    assert int(dom.body.get("data-refreshes") or 0) >= 2

    done = dom.rows["batch"][live_fleet["done"]]
    assert (done["state"], done["finished"], done["failed"], done["total"]) == (
        "done",
        "3",
        "0",
        "3",
    )
    assert done["percent"] == "100%" and done["eta"] == "done" and done["queue"] == "dash"
    assert re.fullmatch(r"\d+s", done["age"])
    waiting = dom.rows["batch"][live_fleet["waiting"]]
    assert (waiting["state"], waiting["finished"], waiting["total"], waiting["percent"]) == (
        "queued",
        "0",
        "2",
        "0%",
    )
    assert waiting["tokens_per_s"] == "–" and waiting["eta"] == "–"

    w = dom.rows["worker"]["dash-w1"]
    # The model by its short name (its folder's), the worker's device under its name.
    assert w["model"] == keys.queue_name_for_model(live_fleet["model"])
    assert w["name"] == "dash-w1" and w["device"].startswith("cpu")
    assert w["batch_in_use"] == "0 / 4" and w["jobs_done"] == "3" and w["health"] == "ok"
    assert re.fullmatch(r"\d+s", w["heartbeat"]) and w["tokens_per_s"] == "0.0"  # idle

    assert dom.rows["queue"]["nobody"]["depth"] == "2"
    assert dom.rows["queue"]["nobody"]["workers"] == "0"
    assert re.fullmatch(r"\d+s", dom.rows["queue"]["nobody"]["oldest"])
    assert dom.rows["queue"]["dash"]["workers"] == "1"
    assert dom.rows["queue"]["dash"]["oldest"] == "–"

    assert status == 200
    snap = json.loads(body)
    assert {b["batch_id"] for b in snap["batches"]} == {live_fleet["done"], live_fleet["waiting"]}
    assert [x["name"] for x in snap["workers"]] == ["dash-w1"]


@needs_chromium
def test_off_loopback_the_data_needs_an_api_key(live_fleet, valkey_url, tmp_path):
    refused = run_mlxq("dashboard", "--host", "0.0.0.0", url=valkey_url)
    assert refused.returncode == 2 and "MLXQ_API_KEYS" in refused.stderr

    env = {**os.environ, "MLXQ_API_KEYS": "k-one,k-two"}
    proc, port = start_dashboard(valkey_url, "--host", "0.0.0.0", env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        page_status, headers, html = get(base + "/")
        assert get(base + "/api/state")[0] == 401
        assert get(base + "/api/state", "wrong")[0] == 401
        assert get(base + "/api/state", "k-two")[0] == 200
        locked = render(base + "/", tmp_path / "a", budget_ms=3000)
        unlocked = render(base + "/#key=k-one", tmp_path / "b", budget_ms=3000)
    finally:
        stop(proc)
    assert page_status == 200 and b"api/state" in html  # the page itself holds no data
    assert "default-src 'none'" in headers["content-security-policy"]
    assert "hidden" not in locked.by_id["login"] and not locked.rows["worker"]
    assert "dash-w1" in unlocked.rows["worker"]
    assert "hidden" in unlocked.by_id["login"]


# -- without a browser -------------------------------------------------------------------------
def test_the_page_loads_nothing_from_the_network():
    from mlxq.api.dashboard import page

    html = page()
    assert not re.search(r"https?://", html)
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)
    assert "__REFRESH_MS__" not in html


def test_snapshot_flags_stalled_workers_and_estimates_the_eta(conn):
    now = time.time()
    fleet.publish(conn, make_info("fresh", queues=["eq"], heartbeat_at=now), ttl=60)
    late = now - STALL_AFTER_S - 5
    fleet.publish(conn, make_info("late", queues=["eq"], heartbeat_at=late), ttl=60)
    reqs = [Request(prompt="x", custom_id=f"c{i}") for i in range(4)]
    info = batches.submit(conn, reqs, queue="eq")

    clock = [1000.0]
    dash = Dashboard(conn, clock=lambda: clock[0])
    first = dash.snapshot()
    assert dash.snapshot() is first  # pages polling together share one read of Redis
    assert {w.name: w.stalled for w in first.workers} == {"fresh": False, "late": True}
    (row,) = first.batches
    assert row.state == "queued" and row.eta_s is None and row.tokens_per_s is None

    batches.cancel_jobs(conn, batches.batch_job_ids(conn, info.batch_id)[:2])  # 2 of 4 done
    clock[0] += 10
    (row,) = dash.snapshot().batches
    assert (row.done, row.cancelled, row.state) == (2, 2, "running")
    assert row.eta_s == pytest.approx(10.0)  # 2 left at 2 per 10 s


def test_missing_api_extra_gives_the_one_line_hint(valkey_url):
    code = "import sys; sys.modules['uvicorn'] = None\nfrom mlxq.cli.main import main\nmain()"
    res = subprocess.run(
        [sys.executable, "-c", code, "dashboard", "--redis-url", valkey_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("mlxq: error: ")
    assert line.endswith("pip install -e '.[api]' in your mlxq clone")
