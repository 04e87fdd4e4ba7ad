"""`mlxq dashboard` says what is true: stuck and unserved work, failures and their reasons,
tokens/s over time and now, busy and idle workers, batches while their jobs run, models by
name, API batches by the id their client knows, a phone-width layout, and Redis down, seen
in a real Chromium.

The browser tests run a real `mlxq dashboard` process and real batches, with a real `mlxq
worker` (tiny model) or with the records real workers' reporters publish (a busy fleet and
the same fleet idle, made deterministically), and read what the page lays out at desktop
(1280 px) and phone (390 px) width.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
from browser import CHROMIUM, Browser
from helpers import free_port
from test_dashboard import get, start_dashboard, start_worker, stop
from test_fleet import make_info

from mlxq.api import store
from mlxq.api.dashboard_history import RateHistory
from mlxq.api.dashboard_rows import worker_row
from mlxq.api.dashboard_state import Dashboard
from mlxq.broker import batches, fleet, keys
from mlxq.engine.hardware import DeviceFacts
from mlxq.engine.scheduler import Scheduler
from mlxq.server import make_server
from mlxq.wire import BatchInfo, Request, Result, Usage, WorkerInfo
from mlxq.worker.reporting import IDLE_AFTER_S, Reporter

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
  // Every value in a row (a cell, or a line of a cell of several), with its tooltip and
  // whether its text is cut (wider than the box that shows it).
  for (const el of document.querySelectorAll("tr [data-field]")) {
    const tr = el.closest("tr");
    const id = tr.dataset.batch || tr.dataset.worker || tr.dataset.queue;
    if (!id) continue;
    const r = el.getBoundingClientRect();
    const style = getComputedStyle(el);
    (rows[id] = rows[id] || {})[el.dataset.field] = {
      text: el.innerText.trim(), left: r.left, right: r.right, width: r.width, top: r.top,
      shown: style.display !== "none" && style.visibility !== "hidden" && r.height > 0,
      label: getComputedStyle(el, "::before").content, color: style.color,
      title: el.title, cut: [el, ...el.querySelectorAll("*")].some(
        (x) => x.scrollWidth > x.clientWidth + 1 && getComputedStyle(x).overflow !== "visible"),
      models: [...el.querySelectorAll("[data-model]")].map((m) => ({
        text: m.innerText.trim(), source: m.dataset.model, loaded: m.dataset.loaded === "true",
        title: m.title, cut: m.scrollWidth > m.clientWidth + 1,
      })),
    };
  }
  const de = document.documentElement;
  const top = (id) => document.getElementById(id).getBoundingClientRect().top;
  return {
    rows, width: de.clientWidth, scrollWidth: de.scrollWidth,
    // Tables that scroll sideways inside their box.
    scrolled: [...document.querySelectorAll(".scroll")].filter(
      (d) => d.scrollWidth > d.clientWidth).map((d) => d.querySelector("table").id),
    tops: {batches: top("batches"), workers: top("workers"), queues: top("queues")},
    alerts: [...document.querySelectorAll("#alerts li")].map((li) => li.innerText),
    status: document.getElementById("status").innerText,
    bars: [...document.querySelectorAll("#chart rect.bin")].filter(
      (b) => Number(b.getAttribute("height")) > 0).length,
    peak: Number(document.getElementById("chart").dataset.peak || 0),
    caption: document.getElementById("tps-caption").innerText,
  };
})()"""
# The cells a person needs on any screen, by the kind of row.
IMPORTANT = {
    "batch": ("batch_id", "state", "progress", "failed", "total", "eta"),
    "worker": ("name", "model", "batch_in_use", "tokens_per_s", "health"),
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
        failing = batches.submit(conn, reqs, queue="dash", source="mixed.jsonl")
        assert batches.wait_for_batch(conn, failing.batch_id, timeout=180).failed == 3
        stuck = batches.submit(conn, reqs[:2], queue="nobody", source="stuck.csv")
        backdate(conn, stuck.batch_id, 7 * 60 + 5)
        big = make_info("big-w", queues=["big"], in_flight=264, max_batch=256)
        fleet.publish(conn, big, ttl=600)
        yield {"failing": failing.batch_id, "stuck": stuck.batch_id, "env": env}
    finally:
        stop(worker)


def run_throughput_batch(conn) -> None:
    """Tokens the dashboard sees generated while it runs (for the chart)."""
    reqs = [Request(prompt=f"tell me {i}", max_tokens=24, custom_id=f"t{i}") for i in range(8)]
    info = batches.submit(conn, reqs, queue="dash")
    assert batches.wait_for_batch(conn, info.batch_id, timeout=180).finished == 8


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
    """Nothing needs sideways scrolling (neither the page nor a table in its box), and every
    important cell is on screen."""
    assert page["scrollWidth"] <= page["width"], (page["scrollWidth"], page["width"])
    assert page["scrolled"] == [], page["scrolled"]
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


# -- a busy fleet, then the same fleet idle ------------------------------------------------------
LLAMA = "/srv/models/mlx-community/Meta-Llama-3.1-70B-Instruct-4bit"
QWEN = "/srv/models/mlx-community/Qwen2.5-7B-Instruct-4bit"
GEMMA = "/srv/models/bartowski/gemma-2-9b-it-Q4_K_M.gguf"
BIG_Q, QWEN_Q, GEMMA_Q = (keys.queue_name_for_model(m) for m in (LLAMA, QWEN, GEMMA))


class FakeWorker:
    """A worker's own ``Reporter`` on a clock the test moves, with no process behind it: what
    it publishes is what a real worker that ended those jobs at those times would."""

    def __init__(
        self, name: str, model: str, queues: list[str], host: str, device: str,
        backend: str = "cuda", max_batch: int = 128, models: tuple = (),
    ) -> None:  # fmt: skip
        self.clock = 0.0
        facts = DeviceFacts(backend, device, 80 * 2**30, 64 * 2**30, host, "linux")
        self.reporter = Reporter(
            name, model, queues, facts, models=list(models), clock=lambda: self.clock
        )
        self.scheduler = Scheduler(
            max_batch=max_batch, kv_bytes_per_token=1 << 17, budget_bytes=40 << 30,
            context_length=8192,
        )  # fmt: skip
        self.host, self.in_flight, self.decoding = host, 0, 0

    def end_jobs(self, at: float, n: int, tokens: int) -> None:
        self.clock = at
        for i in range(n):
            usage = Usage(10, tokens, 10 + tokens)
            self.reporter.finished(Result(f"j{i}", None, "stop", usage=usage))

    def record(self) -> WorkerInfo:
        info = self.reporter.info(self.scheduler, self.in_flight)
        return msgspec.structs.replace(info, host=self.host, decoding=self.decoding)


class Publishing:
    """Publishes each fake worker's record every half second with a fresh heartbeat, as a
    live worker does (records alone would read as stalled after 10 s)."""

    def __init__(self, conn, workers: list[FakeWorker]) -> None:
        self.conn, self.workers = conn, workers
        self.stop = threading.Event()
        self.publish()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def publish(self) -> None:
        for w in self.workers:
            fleet.publish(self.conn, w.record(), ttl=30)

    def _loop(self) -> None:
        while not self.stop.wait(0.5):
            self.publish()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def started_jobs(conn, queue: str, n: int) -> tuple[object, list]:
    """``n`` jobs of ``queue`` taken and started by an RQ worker with no engine (as a real
    worker starts them): (that worker, [(job, queue, execution)])."""
    from mlxq.broker.intake import dequeue_many, register
    from mlxq.worker.rq_worker import MlxqWorker

    worker = MlxqWorker([queue], connection=conn, runner=None, model_name="m")  # type: ignore[arg-type]
    worker.register_birth()
    group = dequeue_many(worker, n)
    executions = register(worker, group)
    return worker, [(j, qu, e) for (j, qu), e in zip(group, executions, strict=True)]


def end_jobs(conn, worker, held: list) -> None:
    """End started jobs as finished, with a result each (the worker's end script)."""
    from mlxq.broker.rq_store import end_script

    endings = [
        end_script.Ending(j, qu, e, Result(j.id, None, "stop", usage=Usage(10, 500, 510)))
        for j, qu, e in held
    ]
    assert all(end_script.end_finished(worker, endings))


@pytest.fixture
def busy_fleet(valkey_url, conn) -> Iterator[dict]:
    """Two GPU workers on a 70B model's queue, each holding 136 jobs (128 decoding) and
    making ~400 tok/s; a worker of two models and a worker of one, both idle since their
    last jobs ended 15-20 s ago. A 300-job batch on the GPUs' queue submitted 2 min ago with
    8 ended and 272 running; a small batch beside it with 2 running; a batch submitted
    through `mlxq api`, waiting. ``idle()`` then ends every job and the workers go idle."""
    from api_servers import KEY, api_client, serve

    gpu_a = FakeWorker("gpu-a", LLAMA, [BIG_Q], "gpu-a.rack4.inference.example.internal",
                       "NVIDIA H100 80GB HBM3")  # fmt: skip
    gpu_b = FakeWorker("gpu-b", LLAMA, [BIG_Q], "gpu-b.rack4.inference.example.internal",
                       "NVIDIA H100 80GB HBM3")  # fmt: skip
    multi = FakeWorker("mac-multi", QWEN, [QWEN_Q, GEMMA_Q], "mac-studio-2.local",
                       "Apple M2 Ultra", "metal", 64, (QWEN, GEMMA))  # fmt: skip
    idle = FakeWorker("mac-idle", GEMMA, [GEMMA_Q], "mac-mini.local", "Apple M4 Pro", "metal", 32)
    gpu_a.end_jobs(at=20, n=33, tokens=750)  # 24,750 tokens in the last minute: 412.5 tok/s
    gpu_b.end_jobs(at=20, n=30, tokens=796)  # 398.0 tok/s
    multi.end_jobs(at=50, n=3, tokens=390)  # 1,170 tokens (19.5 tok/s over a minute)
    idle.end_jobs(at=55, n=2, tokens=558)  # 1,116 tokens (18.6 tok/s over a minute)
    workers = [gpu_a, gpu_b, multi, idle]
    for w in workers:
        w.clock = 70.0
    for w in (gpu_a, gpu_b):
        w.in_flight, w.decoding = 136, 128

    reqs = [Request(prompt=f"q{i}", max_tokens=512, custom_id=f"r{i}") for i in range(300)]
    big = batches.submit(conn, reqs, queue=BIG_Q, model=LLAMA, source="eval-300.jsonl")
    rq_worker, held = started_jobs(conn, BIG_Q, 280)
    end_jobs(conn, rq_worker, held[:8])
    backdate(conn, big.batch_id, 120)
    small = batches.submit(conn, reqs[:4], queue=BIG_Q, model=LLAMA, priority="high")
    small_worker, small_held = started_jobs(conn, BIG_Q, 2)
    assert {j.meta["batch_id"] for j, _, _ in small_held} == {small.batch_id}

    server, thread, port = serve(valkey_url, sweep_interval=0)
    try:
        client = api_client(port, KEY)
        body = {"model": QWEN, "messages": [{"role": "user", "content": "hi"}]}
        line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
        file_id = client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
        api = client.batches.create(
            input_file_id=file_id.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert api.status == "in_progress"
    finally:
        server.should_exit = True
        thread.join(10)
    api_mlxq = store.get_batch(conn, api.id).mlxq_batch_id
    publishing = Publishing(conn, workers)

    def go_idle() -> None:
        end_jobs(conn, rq_worker, held[8:])
        end_jobs(conn, small_worker, small_held)
        for batch_id in (big.batch_id, small.batch_id, api_mlxq):
            batches.cancel_batch(conn, batch_id)
        gpu_a.end_jobs(at=80, n=4, tokens=500)  # their last jobs ended 20 s before they say
        gpu_b.end_jobs(at=80, n=4, tokens=500)
        for w in workers:
            w.clock, w.in_flight, w.decoding = 100.0, 0, 0
        publishing.publish()

    try:
        yield {"big": big.batch_id, "small": small.batch_id, "api": api.id,
               "api_mlxq": api_mlxq, "idle": go_idle}  # fmt: skip
    finally:
        publishing.close()


WORKER_TPS = {"gpu-a": "412.5", "gpu-b": "398.0", "mac-multi": "0.0", "mac-idle": "0.0"}
# Two running batches share the GPUs' 810.5 tok/s by their running jobs (272 and 2 of 274).
BIG_TPS, SMALL_TPS = 810.5 * 272 / 274, 810.5 * 2 / 274


def caption_rates(caption: str) -> tuple[float, float]:
    """(peak, now) of the chart's caption."""
    m = re.search(r"peak ([\d.]+) tok/s · now ([\d.]+) tok/s", caption)
    assert m, caption
    return float(m.group(1)), float(m.group(2))


def read_fleet(browser: Browser, url: str, width: int, height: int, ready: str) -> dict:
    browser.open(url, width, height)
    # The check and the read in one evaluation: a refresh between them could undo the check.
    ready = f"Number(document.body.dataset.refreshes || 0) >= 2 && ({ready})"
    return browser.wait_for(f"({ready}) ? {READ_PAGE} : null", 60)


# (And the chart's rate shown: a refresh on a loaded machine can land before it is.)
BUSY = (
    "document.querySelectorAll('#workers tr[data-worker]').length === 4 && "
    "/now [1-9]/.test(document.getElementById('tps-caption').innerText)"
)
IDLE = (
    "[...document.querySelectorAll('#workers tr[data-worker]')].every("
    "(tr) => tr.querySelector('[data-field=batch_in_use]').innerText.startsWith('0 /')) && "
    "[...document.querySelectorAll('#batches [data-field=state]')].every("
    "(td) => td.innerText.startsWith('done'))"
)


@needs_chromium
def test_a_busy_then_idle_fleet_reads_true_at_desktop_and_phone_width(
    busy_fleet, valkey_url, tmp_path
):
    proc, port = start_dashboard(valkey_url)
    url = f"http://127.0.0.1:{port}/"
    try:
        with Browser(tmp_path / "chromium") as browser:
            busy = {w: read_fleet(browser, url, w, h, BUSY) for w, h in ((1280, 900), (390, 844))}
            busy_fleet["idle"]()
            idle = {w: read_fleet(browser, url, w, h, IDLE) for w, h in ((1280, 900), (390, 844))}
    finally:
        stop(proc)
    log = proc.stdout.read()
    assert "Traceback" not in log, log
    big, small, api = busy_fleet["big"], busy_fleet["small"], busy_fleet["api"]
    for page in busy.values():
        rows = page["rows"]
        # No sideways scroll, and what matters on screen, on a phone as on a laptop.
        assert_all_visible(page, {"batch": big, "worker": "gpu-a", "queue": BIG_Q})
        assert_all_visible(page, {"batch": api, "worker": "mac-multi", "queue": QWEN_Q})
        # The chart shows the rate while the fleet is busy, and its peak is never below now.
        peak, now = caption_rates(page["caption"])
        assert page["bars"] >= 1 and now == 810.5 and peak >= now, page["caption"]
        # Busy workers show their rate; idle ones (however recently busy) show 0.
        assert {w: rows[w]["tokens_per_s"]["text"] for w in WORKER_TPS} == WORKER_TPS
        # Models by their short names in full, the source in the tooltip; all of a worker
        # of several models, the loaded one marked.
        (llama,) = rows["gpu-a"]["model"]["models"]
        assert (llama["text"], llama["source"], llama["cut"]) == (BIG_Q, LLAMA, False)
        assert LLAMA in llama["title"]
        qwen, gemma = rows["mac-multi"]["model"]["models"]
        assert qwen["text"] == f"{QWEN_Q} loaded" and qwen["loaded"] and not qwen["cut"]
        assert gemma["text"] == GEMMA_Q and not gemma["loaded"] and not gemma["cut"]
        assert (qwen["source"], gemma["source"]) == (QWEN, GEMMA)
        # The 300-job batch moves while its jobs run: 8 ended, 272 running, its estimated
        # share of the GPUs' rate, an ETA at its pace so far.
        b = rows[big]
        assert b["percent"]["text"] == "2.6%" and b["running"]["text"] == "· 272 running"
        assert b["state"]["text"] == "running" and b["finished"]["text"] == "8"
        assert b["tokens_per_s"]["text"] == f"{BIG_TPS:.1f}"
        assert "estimated" in b["tokens_per_s"]["title"] and BIG_Q in b["tokens_per_s"]["title"]
        assert rows[small]["tokens_per_s"]["text"] == f"{SMALL_TPS:.1f}"
        eta = re.fullmatch(r"(\d+)m", b["eta"]["text"])
        assert eta and 60 <= int(eta.group(1)) <= 90, b["eta"]  # 292 left at 8 per ~2 min
        assert "since submit" in b["eta"]["title"]
        # An API batch under the id its client sees (mlxq's own in the tooltip).
        a = rows[api]
        assert api.startswith("batch_") and a["batch_id"]["text"] == api
        assert a["batch_id"]["title"] == f"mlxq batch {busy_fleet['api_mlxq']}"
        assert busy_fleet["api_mlxq"] not in rows
    # On a phone the fleet comes first, the list of batches after it.
    tops = busy[390]["tops"]
    assert tops["workers"] < tops["queues"] < tops["batches"], tops
    tops = busy[1280]["tops"]
    assert tops["batches"] < tops["workers"] < tops["queues"], tops

    for page in idle.values():
        rows = page["rows"]
        assert page["scrollWidth"] <= page["width"] and page["scrolled"] == []
        # Idle: every worker at 0, the fleet at 0, the busy minutes still in the chart.
        assert {w: rows[w]["tokens_per_s"]["text"] for w in WORKER_TPS} == dict.fromkeys(
            WORKER_TPS, "0.0"
        )
        peak, now = caption_rates(page["caption"])
        assert now == 0.0 and peak >= 810.5 and page["bars"] >= 1, page["caption"]
        assert rows[big]["eta"]["text"] == "done" and rows[big]["tokens_per_s"]["text"] == "–"


# -- without a browser -------------------------------------------------------------------------
def test_a_batch_that_stops_moving_is_flagged_after_the_configured_time(conn):
    reqs = [Request(prompt="x", custom_id=f"c{i}") for i in range(4)]
    info = batches.submit(conn, reqs, queue="eq")
    wall = [time.time()]
    dash = Dashboard(conn, clock=lambda: wall[0], wall=lambda: wall[0], stuck_after_s=60)

    def look(advance: float) -> list[str]:
        wall[0] += advance  # a live worker serves the queue all along
        fleet.publish(conn, make_info("w", queues=["eq"], heartbeat_at=wall[0]), ttl=60)
        (row,) = dash.snapshot().batches
        return row.flags

    batches.cancel_jobs(conn, batches.batch_job_ids(conn, info.batch_id)[:1])  # one ended: it moved
    assert look(0) == []
    assert look(59) == []  # quiet for less than the minute asked for
    assert look(61) == ["no progress for 2 min"]
    batches.cancel_jobs(conn, batches.batch_job_ids(conn, info.batch_id)[1:2])  # it moves again
    assert look(5) == []


def test_a_stalled_worker_does_not_count_as_serving_its_queue(conn):
    now = time.time()
    fleet.publish(conn, make_info("gone", queues=["sq"], heartbeat_at=now, state="stalled"), 60)
    batches.submit(conn, [Request(prompt="x")], queue="sq")
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


def test_rate_history_bins_the_sampled_rate_and_peak_is_never_below_now():
    hist = RateHistory(window_s=60, bin_s=10)
    hist.sample(100.0, at=100.0)
    hist.sample(300.0, at=104.0)  # bin [100, 110): mean 200
    hist.sample(50.0, at=112.0)
    series = hist.series(at=131.0, now_tps=900.0)  # bins [70, 80) .. [120, 130), then [130, 140)
    assert series.rates == [None, None, None, 200.0, 50.0, None, None]
    assert series.now_tps == 900.0 and series.peak_tps == 900.0  # now is above every bin
    hist.sample(900.0, at=131.0)  # what the snapshot samples as it reads "now"
    assert hist.series(at=131.5, now_tps=900.0).rates[-1] == 900.0  # the bin filling
    assert hist.series(at=150.0, now_tps=0.0).peak_tps == 900.0
    # Idle samples in the busy bin pull its bar down, never the peak a user saw as "now".
    hist.sample(0.0, at=135.0)
    later = hist.series(at=150.0, now_tps=0.0)
    assert later.rates[-3] == 450.0 and later.peak_tps == 900.0


def test_a_worker_publishes_0_tok_s_once_idle():
    clock = [0.0]
    facts = DeviceFacts("cpu", "cpu", 2**30, 2**29, "h", "linux")
    reporter = Reporter("w", "m", ["m"], facts, clock=lambda: clock[0])
    clock[0] = 30.0
    reporter.finished(Result("j", None, "stop", usage=Usage(5, 600, 605)))
    assert reporter.recent_tps(in_flight=3) == 20.0  # 600 tokens over its 30 s
    clock[0] = 30.0 + IDLE_AFTER_S / 2
    assert reporter.recent_tps(in_flight=0) > 0  # just emptied: between two batches
    clock[0] = 30.0 + IDLE_AFTER_S
    assert reporter.recent_tps(in_flight=0) == 0.0  # idle: it generates nothing now
    assert reporter.recent_tps(in_flight=2) > 0  # busy again: its last minute's rate


def test_a_busy_worker_none_of_whose_jobs_ended_yet_shows_no_rate_not_zero():
    row = worker_row(make_info("w", in_flight=40, recent_tps=0.0), time.time())
    assert row.tokens_per_s is None and "none of which ended" in row.tokens_per_s_basis
    row = worker_row(make_info("w", in_flight=0, recent_tps=0.0), time.time())
    assert row.tokens_per_s == 0.0 and row.tokens_per_s_basis == "idle: it holds no job"
    multi = make_info("w", model="/m/a/Qwen-7B", models=["/m/a/Qwen-7B", "/m/b/gemma.gguf"])
    names = [(m.name, m.source, m.loaded) for m in worker_row(multi, time.time()).models]
    assert names == [("Qwen-7B", "/m/a/Qwen-7B", True), ("gemma", "/m/b/gemma.gguf", False)]
