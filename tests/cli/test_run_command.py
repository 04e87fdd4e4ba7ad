"""``mlxq run`` as a user runs it (a subprocess, its own embedded Valkey): failed requests
make it exit non-zero with their reasons in one line, a SIGINT or SIGTERM says how to get
what it left undone (test_run_resume.py resumes it), ``--log-level info`` shows the
worker's decisions, and the output's suffix (or --format) picks how results are written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import run_mlxq, start_until

ENV = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}  # an embedded Valkey


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_failed_requests_exit_non_zero_with_their_reasons(tmp_path, tiny_model):
    src = _write(
        tmp_path / "in.jsonl",
        [
            {"custom_id": "ok", "prompt": "Hi", "max_tokens": 4},
            {"custom_id": "long1", "prompt": "Hi", "max_tokens": 5000},
            {"custom_id": "long2", "prompt": "Hello there", "max_tokens": 5000},
        ],
    )
    out = tmp_path / "out.jsonl"
    run = run_mlxq("run", str(src), "--model", tiny_model, "-o", str(out), "--json", env=ENV)
    assert run.returncode == 1, run.stderr
    assert json.loads(run.stdout)["failed"] == 2  # the summary still comes, for scripts
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["ok"]["finish_reason"] != "error" and rows["long1"]["finish_reason"] == "error"
    # The tiny model's context is 2048: max_tokens alone is over it, whatever the prompt.
    assert (
        "lower max_tokens to at most 2045 (alone it exceeds the context)"
        in (rows["long1"]["error"])
    )
    assert "shorten the prompt" not in rows["long1"]["error"]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxq: error: 2 of 3 requests failed: 2x the prompt is ")
    assert last.endswith(f"(error lines in {out})")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_says_how_to_get_the_rest(tmp_path, tiny_model, sig):
    src = _write(
        tmp_path / "in.jsonl", [{"prompt": f"p{i}", "max_tokens": 1500} for i in range(40)]
    )
    out, few = tmp_path / "out.jsonl", ["--max-batch", "2", "--data-dir", str(tmp_path / "d")]
    args = ("run", str(src), "--model", tiny_model, "-o", str(out), *few)
    proc, _ = start_until(args, ENV, "^running ", subprocess.DEVNULL)
    proc.send_signal(sig)
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert proc.wait(240) == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("mlxq: error: interrupted with "), err
    assert "not done; run the same command again to resume" in last, err
    assert "--wait" not in err and "Traceback" not in err and not out.exists()


def test_log_level_info_shows_the_workers_decisions(tmp_path, tiny_model):
    src = _write(tmp_path / "in.jsonl", [{"prompt": "Hi", "max_tokens": 2}])
    args = ("run", str(src), "--model", tiny_model, "-o", str(tmp_path / "out.jsonl"))
    quiet = run_mlxq(*args, env=ENV)
    told = run_mlxq(*args, "--log-level", "info", env=ENV)
    assert quiet.returncode == told.returncode == 0, quiet.stderr + told.stderr
    assert " INFO " not in quiet.stderr  # the default: a progress bar, no per-job lines
    assert " INFO mlxq.worker: device: " in told.stderr
    assert " INFO mlxq.worker: model: " in told.stderr


def _refused(tmp_path: Path, lines: list[dict], model: str, *args: str) -> tuple[str, Path]:
    """``mlxq run`` refused at start, with its home in ``tmp_path``: its one-line error
    (asserted: exit 1, no traceback) and the home."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    src = _write(tmp_path / "in.jsonl", lines)
    args = ("run", str(src), "--model", model, "-o", str(tmp_path / "out.jsonl"), *args)
    run = run_mlxq(*args, env={**ENV, "HOME": str(home)})
    err = run.stderr.strip()
    assert run.returncode == 1 and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("mlxq: error: "), err
    return err, home


def test_a_run_refused_for_a_missing_model_leaves_no_folder(tmp_path):
    err, home = _refused(tmp_path, [{"prompt": "Hi"}], str(tmp_path / "missing"))
    assert "no such folder" in err
    assert not (home / ".mlxq").exists(), list(home.rglob("*"))
    assert not (tmp_path / "out.jsonl").exists()


def test_a_run_refused_for_a_line_naming_an_unknown_model_leaves_no_folder(tmp_path, tiny_model):
    lines = [{"prompt": "Hi"}, {"prompt": "Hi", "model": "no-such-model"}]
    err, home = _refused(tmp_path, lines, tiny_model)
    assert "1 request names model 'no-such-model'" in err
    assert not (home / ".mlxq").exists(), list(home.rglob("*"))
    # The likely fix comes first: a file written for another service's model.
    assert err.index("--ignore-line-models") < err.index("no such folder"), err


def test_a_refused_run_keeps_a_data_folder_it_did_not_make(tmp_path):
    """A folder that was there before (an earlier run's, to resume) stays as it was; its
    parents too."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "earlier").write_text("kept")
    _refused(tmp_path, [{"prompt": "Hi"}], str(tmp_path / "missing"), "--data-dir", str(data))
    assert (data / "earlier").read_text() == "kept"
    made = tmp_path / "made" / "data"  # made by this run: removed, with its new parent
    _refused(tmp_path, [{"prompt": "Hi"}], str(tmp_path / "missing"), "--data-dir", str(made))
    assert not (tmp_path / "made").exists()
