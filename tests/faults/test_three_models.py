"""Issue 29's target, as users run it: one file whose lines name three models, through
`mlxq run` and through two long-lived workers that each serve all three (started before the
jobs, idle, never `--burst`). Nothing is lost, results come back in input order, each made
by its line's model (its text is that model's own greedy answer), and switches are logged."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import redis

from mlxq.broker import batches
from mlxq.broker.rq_store import rq_keys
from tests.helpers import Worker, run_mlxq, wait_blocked

pytestmark = pytest.mark.slow
NAMES = ("alpha", "beta", "gamma")
SWITCHED = re.compile(r"switched model from (\S+) to (\S+) in [0-9.]+s")


@pytest.fixture(scope="module")
def three_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three tiny random-weight models of different weights, by name."""
    from mlxq.engine.models.make import make_model

    root = tmp_path_factory.mktemp("three-models")
    return {n: str(make_model(root / n, "tiny", seed=i + 1)) for i, n in enumerate(NAMES)}


def _mixed_file(path: Path, models: dict[str, str], rounds: int, unnamed: bool) -> list[str]:
    """Lines cycling through the three models (and, with ``unnamed``, a line naming none),
    the same prompt each; returns each line's model name (None: no model)."""
    cycle = [*NAMES, None] if unnamed else list(NAMES)
    named = [cycle[i % len(cycle)] for i in range(rounds * len(cycle))]
    with path.open("w") as f:
        for i, name in enumerate(named):
            line = {"custom_id": f"c{i}", "prompt": "Three models, one file:", "max_tokens": 5}
            if name is not None:
                line["model"] = models[name]
            f.write(json.dumps(line) + "\n")
    return named


def _check_results(out: Path, models: dict[str, str], named: list[str | None]) -> list[dict]:
    """Results in input order, each from its line's model, one greedy answer per model
    (and different models answer differently: the check can tell them apart)."""
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(len(named))]
    by_path = {path: name for name, path in models.items()}
    texts: dict[str, set[str]] = {}
    for r, name in zip(results, named, strict=True):
        assert r["finish_reason"] == "length", r
        if name is not None:
            assert r["model"] == models[name], (r, name)
        texts.setdefault(by_path[r["model"]], set()).add(r["text"])
    assert all(len(t) == 1 for t in texts.values()), texts
    assert len({t for ts in texts.values() for t in ts}) == len(texts)
    return results


def test_a_three_model_file_through_two_workers_that_serve_all_three(
    valkey_url: str, conn: redis.Redis, three_models: dict[str, str], tmp_path: Path
):
    paths = list(three_models.values())
    more = [a for p in paths[1:] for a in ("--model", p)]
    workers = [
        Worker(valkey_url, paths[0], *more, "--min-model-seconds", "0", log=tmp_path / f"w{i}.log")
        for i in range(2)
    ]
    try:
        for w in workers:
            w.wait_listening(conn)
        wait_blocked(conn, 2)  # both idle in their blocking pull before the jobs come
        src = tmp_path / "mixed.jsonl"
        named = _mixed_file(src, three_models, rounds=6, unnamed=True)
        out = tmp_path / "out.jsonl"
        args = ("submit", str(src), "--wait", "--timeout", "180", "-o", str(out))
        done = run_mlxq(*args, "--require-workers", url=valkey_url)
        assert done.returncode == 0, done.stderr
        results = _check_results(out, three_models, named)
        batch_id = results[0]["batch_id"]
        ids = batches.batch_job_ids(conn, batch_id)
        assert [conn.xlen(rq_keys.results_key(j)) for j in ids] == [1] * len(named)
        status = batches.batch_status(conn, batch_id)
        assert (status.finished, status.queued, status.started) == (len(named), 0, 0)
    finally:
        logs = [w.stop() for w in workers]
    # Both started on alpha; beta's and gamma's lines made the fleet switch, each logged.
    switches = [s for log in logs for s in SWITCHED.findall(log)]
    assert {Path(to).name for _, to in switches} >= {"beta", "gamma"}, logs
    assert all(w.proc.returncode == 0 for w in workers), logs
    assert not any("Traceback" in log for log in logs), logs


def test_a_three_model_file_through_one_mlxq_run(three_models: dict[str, str], tmp_path: Path):
    src = tmp_path / "mixed.jsonl"
    named = _mixed_file(src, three_models, rounds=3, unnamed=False)
    env = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}
    out = tmp_path / "out.jsonl"
    args = ("run", str(src), "-o", str(out), "--json", "--data-dir", str(tmp_path / "data"))
    done = run_mlxq(*args, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["finished"] == len(named)
    _check_results(out, three_models, named)
    loads = [line.split("loading ")[-1] for line in done.stderr.splitlines() if "loading" in line]
    assert loads == list(three_models.values()), done.stderr  # one after another, in order
