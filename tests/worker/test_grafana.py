"""The Grafana board in deploy/: every query names a metric a real worker exports, and the
compose file provisions it with the Prometheus it queries."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, free_port, wait_for_port

from mlxq.broker import batches
from mlxq.wire import Request

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

yaml = pytest.importorskip("yaml")

DEPLOY = ROOT / "deploy"
BOARD = DEPLOY / "grafana" / "dashboards" / "mlxq.json"
# Names a family of each type puts in an exposition, whatever its samples so far.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}
# PromQL words that look like metric names but are not.
_FUNCTIONS = {"rate", "sum", "max", "count", "histogram_quantile", "label_values"}


def board() -> dict:
    return json.loads(BOARD.read_text())


def queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every panel target and templating query."""
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    for var in dash["templating"]["list"]:
        out.append((f"${var['name']}", var["definition"]))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (strings, labels and $variables left out)."""
    expr = re.sub(r"label_values\((\w+),\s*\w+\)", r"\1", expr)  # Grafana's, with a label
    expr = re.sub(r'"[^"]*"', "", expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # grouping labels
    words = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", expr))
    return {w for w in words if w not in _FUNCTIONS}


def exported_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


@pytest.fixture
def worker_port(valkey_url, conn, tiny_model) -> Iterator[int]:
    """The metrics port of a real `mlxq worker` that has served a batch with a rejected job."""
    port = free_port()
    args = ("--metrics-port", str(port), "--name", "graf-w1")
    worker = subprocess.Popen(
        [sys.executable, "-m", "mlxq", "worker", "--model", tiny_model, "-q", "graf", *args],
        cwd=ROOT,
        env={**os.environ, "MLXQ_REDIS_URL": valkey_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_port(port, worker, timeout=120)
        reqs = [Request(prompt=f"p{i}", max_tokens=3) for i in range(3)]
        reqs.append(Request(prompt=[10**9], max_tokens=3))  # no such token: rejected
        info = batches.submit(conn, reqs, queue="graf")
        status = batches.wait_for_batch(conn, info.batch_id, timeout=180)
        assert (status.finished, status.failed) == (3, 1), status
        time.sleep(2.5)  # one more report interval: the gauges are set
        yield port
    finally:
        worker.terminate()
        worker.wait(60)


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_every_query_names_a_metric_the_worker_exports(worker_port):
    scrape = fetch(f"http://127.0.0.1:{worker_port}/metrics")
    exported = exported_names(scrape)
    assert "mlxq_job_failures_total" in {
        s.name for f in text_string_to_metric_families(scrape) for s in f.samples
    }  # the failure panel has data to show
    checked = 0
    for title, expr in queries(board()):
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        missing = names - exported
        assert not missing, f"{title}: {sorted(missing)} not exported by the worker"
        checked += len(names)
    assert checked >= 20


PROMETHEUS = shutil.which("prometheus")


def grafana_to_promql(expr: str) -> str:
    """A panel's query as Prometheus takes it: Grafana's variables filled in."""
    expr = re.sub(r"label_values\((\w+),\s*\w+\)", r"\1", expr)
    return expr.replace("$__rate_interval", "30s").replace("$instance", ".*")


@pytest.mark.skipif(
    PROMETHEUS is None, reason="Prometheus is not installed (apt-get install prometheus)"
)
def test_every_query_returns_series_from_a_real_prometheus(worker_port, tmp_path):
    """Prometheus scrapes the worker every second; every panel's query must parse and
    return at least one series (values may be 0 or NaN: the batch is over)."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "w", "static_configs": [{"targets": [f"127.0.0.1:{worker_port}"]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    args = [
        f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    log = (tmp_path / "prometheus.log").open("w")
    prom = subprocess.Popen([PROMETHEUS, *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, prom, timeout=60)
        pending = {expr: title for title, expr in queries(board())}
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            time.sleep(1)
            for expr in list(pending):
                q_url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(
                    {"query": grafana_to_promql(expr)}
                )
                try:
                    answer = json.loads(fetch(q_url))
                except urllib.error.HTTPError as e:  # a query Prometheus cannot parse
                    pytest.fail(f"{pending[expr]}: {expr!r}: {e.read().decode()}")
                if answer["status"] == "success" and answer["data"]["result"]:
                    del pending[expr]
        assert not pending, f"queries that returned no series: {sorted(pending.values())}"
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()


def test_the_board_covers_what_operators_watch():
    dash = board()
    exprs = " ".join(e for _t, e in queries(dash))
    for metric in (
        "mlxq_generated_tokens_total",
        "mlxq_queue_depth",
        "mlxq_jobs_in_flight",
        "mlxq_time_to_first_token_seconds_bucket",
        "mlxq_queue_wait_seconds_bucket",
        "mlxq_job_failures_total",
        "mlxq_memory_active_bytes",
        "mlxq_kv_reserved_bytes",
    ):
        assert metric in exprs, metric
    assert "histogram_quantile(0.99, sum by (le) (rate(mlxq_time_to_first_token" in exprs
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"][
            "w"
        ] <= 24


def test_compose_provisions_the_board_and_its_data_source():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    grafana, prometheus = compose["services"]["grafana"], compose["services"]["prometheus"]
    assert grafana["profiles"] == prometheus["profiles"] == ["monitoring"]
    mounts = {m.split(":")[1]: DEPLOY / m.split(":")[0] for m in grafana["volumes"] if "/" in m}
    provisioning = mounts["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    (source,) = sources["datasources"]
    uids = {p["datasource"]["uid"] for p in board()["panels"]}
    assert uids == {source["uid"]}
    assert source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((provisioning / "dashboards" / "mlxq.yaml").read_text())
    board_dir = Path(providers["providers"][0]["options"]["path"])
    assert (mounts[str(board_dir)] / BOARD.name).exists()
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == str(
        board_dir / BOARD.name
    )
    prom_mounts = dict(m.split(":")[1::-1] for m in prometheus["volumes"] if m.startswith("./"))
    config = yaml.safe_load((DEPLOY / prom_mounts["/etc/prometheus/prometheus.yml"]).read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert all(p.startswith("127.0.0.1:") for s in (grafana, prometheus) for p in s["ports"])
