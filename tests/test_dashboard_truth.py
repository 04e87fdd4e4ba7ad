"""`mlxq dashboard` says what is true: stuck and unserved work, failures and their reasons,
tokens/s over time, a phone-width layout, and Redis down, seen in a real Chromium.

The browser tests run a real `mlxq worker` (tiny model), a real `mlxq dashboard` process and
real batches, and read what the page lays out at desktop (1280 px) and phone (390 px) width.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator

import msgspec
import pytest
from browser import CHROMIUM, Browser
from helpers import free_port
from test_dashboard import get, start_dashboard, start_worker, stop
from test_fleet import make_info

from mlxq.api.dashboard_history import TokenHistory
from mlxq.api.dashboard_state import Dashboard, worker_row
from mlxq.broker import batches as q
from mlxq.broker import fleet, keys
from mlxq.server import make_server
from mlxq.wire import BatchInfo, Request

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)"
)

RED = "rgb(209, 69, 59)"  # --bad
# What a person reads off the page: every data row's cells with their text, where they are
# laid out, the label a phone shows beside each, and the colour of the text.
READ_PAGE = """(() => {
  const rows = {};
  for (const td of document.querySelectorAll("tr td[data-field]")) {
    const tr = td.closest("tr");
    const id = tr.dataset.batch || tr.dataset.worker || tr.dataset.queue;
    if (!id) continue;
    const r = td.getBoundingClientRect();
    const style = getComputedStyle(td);
    (rows[id] = rows[id] || {})[td.dataset.field] = {
      text: td.innerText.trim(), left: r.left, right: r.right, width: r.width,
      shown: style.display !== "none" && style.visibility !== "hidden" && r.height > 0,
      label: getComputedStyle(td, "::before").content, color: style.color,
    };
  }
  const de = document.documentElement;
  return {
    rows, width: de.clientWidth, scrollWidth: de.scrollWidth,
    alerts: [...document.querySelectorAll("#alerts li")].map((li) => li.innerText),
    status: document.getElementById("status").innerText,
    bars: document.querySelectorAll("#chart rect.bin").length,
    peak: Number(document.getElementById("chart").dataset.peak || 0),
    caption: document.getElementById("tps-caption").innerText,
  };
})()"""
# The cells a person needs on any screen, by the kind of row.
IMPORTANT = {
    "batch": ("batch_id", "state", "progress", "failed", "total", "eta"),
    "worker": ("name", "batch_in_use", "tokens_per_s", "health"),
    "queue": ("name", "depth", "workers", "flag"),
}


def backdate(conn, batch_id: str, seconds: float) -> None:
    """Make a batch look submitted ``seconds`` earlier (as if the dashboard looked later)."""
    raw = conn.get(keys.batch_info(batch_id))
    info = msgspec.json.decode(raw, type=BatchInfo)
    older = msgspec.structs.replace(info, created_at=info.created_at - seconds)
    conn.set(keys.batch_info(batch_id), msgspec.json.encode(older), keepttl=True)


@pytest.fixture
def troubled_fleet(valkey_url, conn, tiny_model) -> Iterator[dict]:
    """A real worker on queue `dash` that finished a batch with 3 failures; a fake worker
    holding 264 jobs with a batch of 256; a batch waiting 7 min on a queue nobody serves."""
    env = {**os.environ, "MLXQ_REDIS_URL": valkey_url}
    worker = start_worker(tiny_model, env)
    try:
        # The tiny model's context is 2,048 tokens: these 3 cannot run (each says its numbers).
        reqs = [Request(prompt="hi", max_tokens=4, custom_id="ok")] + [
            Request(prompt="hi", max_tokens=3000 + 1000 * i, custom_id=f"big{i}") for i in range(3)
        ]
        failing = q.submit(conn, reqs, queue="dash", source="mixed.jsonl")
        assert q.wait_for_batch(conn, failing.batch_id, timeout=180).failed == 3
        stuck = q.submit(conn, reqs[:2], queue="nobody", source="stuck.csv")
        backdate(conn, stuck.batch_id, 7 * 60 + 5)
        big = make_info("big-w", queues=["big"], in_flight=264, max_batch=256)
        fleet.publish(conn, big, ttl=600)
        yield {"failing": failing.batch_id, "stuck": stuck.batch_id, "env": env}
    finally:
        stop(worker)


def run_throughput_batch(conn) -> None:
    """Tokens the dashboard sees generated while it runs (for the chart)."""
    reqs = [Request(prompt=f"tell me {i}", max_tokens=24, custom_id=f"t{i}") for i in range(8)]
    info = q.submit(conn, reqs, queue="dash")
    assert q.wait_for_batch(conn, info.batch_id, timeout=180).finished == 8


def quiet_line(text: str) -> str:
    """The "no progress for N min" of a batch's flags."""
    m = re.search(r"no progress for \d+ min", text)
    assert m, text
    return m.group(0)


def quiet_minutes(text: str) -> int:
    return int(quiet_line(text).split()[-2])


def read_page(browser: Browser, url: str, width: int, height: int) -> dict:
    browser.open(url, width, height)
    # Redrawn at least twice, with the chart showing the batch run after the server started.
    browser.wait_for(
        "Number(document.body.dataset.refreshes || 0) >= 2 && "
        "Number(document.getElementById('chart').dataset.peak || 0) > 0",
        timeout=90,
    )
    return browser.evaluate(READ_PAGE)


def assert_all_visible(page: dict, ids: dict[str, str]) -> None:
    """Nothing needs sideways scrolling, and every important cell is on screen."""
    assert page["scrollWidth"] <= page["width"], (page["scrollWidth"], page["width"])
    for kind, row_id in ids.items():
        for name in IMPORTANT[kind]:
            c = page["rows"][row_id][name]
            assert c["shown"] and c["width"] > 0, (row_id, name, c)
            assert 0 <= c["left"] and c["right"] <= page["width"] + 0.5, (row_id, name, c)


@needs_chromium
def test_problems_failures_and_throughput_show_at_desktop_and_phone_width(
    troubled_fleet, valkey_url, conn, tmp_path
):
    proc, port = start_dashboard(valkey_url)
    try:
        assert get(f"http://127.0.0.1:{port}/api/state")[0] == 200  # it has seen the fleet
        run_throughput_batch(conn)
        url = f"http://127.0.0.1:{port}/"
        with Browser(tmp_path / "chromium") as browser:
            desktop = read_page(browser, url, 1280, 900)
            phone = read_page(browser, url, 390, 844)
    finally:
        stop(proc)
    log = proc.stdout.read()
    assert "Traceback" not in log, log
    failing, stuck = troubled_fleet["failing"], troubled_fleet["stuck"]
    ids = {"batch": failing, "worker": "dash-w1", "queue": "nobody"}
    assert_all_visible(desktop, ids)
    assert_all_visible(phone, ids)
    # On a phone each value has its column's name beside it.
    assert phone["rows"][failing]["failed"]["label"] == '"failed"'
    assert phone["rows"]["big-w"]["batch_in_use"]["label"] == '"batch in use"'

    for page in (desktop, phone):
        rows = page["rows"]
        # Failures: counted in red, the state is not a green "done", and the reasons show.
        f = rows[failing]
        assert f["state"]["text"] == "done · 3 failed" and f["state"]["color"] == RED
        assert f["failed"]["text"] == "3" and f["failed"]["color"] == RED
        reasons = f["detail"]["text"]
        assert "3 failed, most often:" in reasons
        assert "3×the prompt is 2 tokens and max_tokens is 3000" in reasons  # one example
        assert "is 2048 tokens" in reasons
        # Stuck and unserved work: on the batch, on its queue, and at the top of the page.
        s = rows[stuck]["detail"]["text"]
        assert "no worker serves queue nobody" in s and 7 <= quiet_minutes(s) < 30
        assert f"batch {stuck}: {quiet_line(s)}" in page["alerts"]
        assert rows["nobody"]["flag"]["text"] == "no worker serves queue nobody"
        assert rows["nobody"]["workers"]["color"] == RED
        assert "no worker serves queue nobody" in page["alerts"]
        assert f"batch {failing}: 3 of 4 failed" in page["alerts"]
        assert rows["dash"]["flag"]["text"] == "" and rows["dash"]["workers"]["text"] == "1"
        # Never more in use than the batch: the prefetched jobs are said apart.
        assert rows["big-w"]["batch_in_use"]["text"] == "256 / 256 +8 waiting"
        assert rows["dash-w1"]["batch_in_use"]["text"] == "0 / 4"
        # Tokens/s over time: bars for the bins this dashboard saw, since it started.
        assert page["bars"] >= 1 and page["peak"] > 0
        assert "since" in page["caption"] and "tok/s" in page["caption"]


@needs_chromium
def test_redis_down_is_said_as_such_without_tracebacks(tmp_path):
    port = free_port()
    server = make_server(port=port)
    server.start()
    env = {**os.environ, "MLXQ_REDIS_URL": f"redis://127.0.0.1:{port}/0"}
    proc, dash_port = start_dashboard(env["MLXQ_REDIS_URL"], "--log-level", "info", env=env)
    base = f"http://127.0.0.1:{dash_port}"
    try:
        assert get(base + "/api/state")[0] == 200
        server.stop()
        with Browser(tmp_path / "chromium") as browser:
            browser.open(base + "/", 1280, 900)
            shown = browser.wait_for(
                "(() => { const s = document.getElementById('status');"
                " return s.classList.contains('error') && s.innerText; })()"
            )
        status, headers, body = get(base + "/api/state")  # after the page's 1 s share of a read
    finally:
        stop(proc)
        if server.is_running():
            server.stop()
    log = proc.stdout.read()
    assert status == 503 and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error.startswith(f"cannot reach Redis at 127.0.0.1:{port}: "), error
    assert shown.startswith(f"cannot reach Redis at 127.0.0.1:{port}: ")
    assert "dashboard server" not in shown and "HTTP" not in shown
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    # One line in the log when it went down, not one per poll.
    assert log.count(f"cannot reach Redis at 127.0.0.1:{port}") == 1, log


# -- without a browser -------------------------------------------------------------------------
def test_a_batch_that_stops_moving_is_flagged_after_the_configured_time(conn):
    reqs = [Request(prompt="x", custom_id=f"c{i}") for i in range(4)]
    info = q.submit(conn, reqs, queue="eq")
    wall = [time.time()]
    dash = Dashboard(conn, clock=lambda: wall[0], wall=lambda: wall[0], stuck_after_s=60)

    def look(advance: float) -> list[str]:
        wall[0] += advance  # a live worker serves the queue all along
        fleet.publish(conn, make_info("w", queues=["eq"], heartbeat_at=wall[0]), ttl=60)
        (row,) = dash.snapshot().batches
        return row.flags

    q.cancel_jobs(conn, q.batch_job_ids(conn, info.batch_id)[:1])  # one ended: it moved
    assert look(0) == []
    assert look(59) == []  # quiet for less than the minute asked for
    assert look(61) == ["no progress for 2 min"]
    q.cancel_jobs(conn, q.batch_job_ids(conn, info.batch_id)[1:2])  # it moves again
    assert look(5) == []


def test_a_stalled_worker_does_not_count_as_serving_its_queue(conn):
    now = time.time()
    fleet.publish(conn, make_info("gone", queues=["sq"], heartbeat_at=now, state="stalled"), 60)
    q.submit(conn, [Request(prompt="x")], queue="sq")
    snap = Dashboard(conn).snapshot()
    (queue,) = [x for x in snap.queues if x.name == "sq"]
    assert queue.workers == 0 and queue.flag == "no worker serves queue sq (1 stalled)"
    assert snap.batches[0].flags == ["no worker serves queue sq (1 stalled)"]
    assert "worker gone stalled" in snap.alerts


def test_batch_in_use_never_exceeds_the_batch():
    row = worker_row(make_info("w", in_flight=264, max_batch=256), time.time())
    assert (row.in_batch, row.waiting, row.max_batch, row.in_flight) == (256, 8, 256, 264)
    row = worker_row(make_info("w", in_flight=3, max_batch=256), time.time())
    assert (row.in_batch, row.waiting) == (3, 0)
    # A worker that says what it decodes: its KV budget admitted 40 of the 72 it holds.
    row = worker_row(make_info("w", in_flight=72, max_batch=64, decoding=40), time.time())
    assert (row.in_batch, row.waiting) == (40, 32)


def test_token_history_counts_what_each_worker_generated_per_bin():
    hist = TokenHistory(window_s=60, bin_s=10)
    w = make_info("w", tokens_generated=1000, started_at=1.0)
    hist.sample([w], at=100.0)  # a baseline only: when its 1000 tokens came is unknown
    hist.sample([msgspec.structs.replace(w, tokens_generated=1300)], at=104.0)
    hist.sample([msgspec.structs.replace(w, tokens_generated=1500)], at=112.0)
    restarted = msgspec.structs.replace(w, tokens_generated=50, started_at=200.0)
    hist.sample([restarted], at=125.0)  # a new process: a new baseline, nothing negative
    hist.sample([msgspec.structs.replace(restarted, tokens_generated=150)], at=126.0)
    series = hist.series(at=131.0, workers=[restarted])
    # bins [70, 80) .. [120, 130): nothing sampled before 100
    assert series.rates == [None, None, None, 30.0, 20.0, 10.0]
    assert series.now_tps == restarted.recent_tps
