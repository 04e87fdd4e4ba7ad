"""First-contact errors: every start-up failure of a command is one line, a non-zero exit
and no traceback, run as a user runs it (a real ``mlxq`` process)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
import redis
from helpers import ROOT, run_mlxq
from test_lora import make_adapter

PROMPTS = str(ROOT / "examples" / "prompts.jsonl")


def assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The command failed with exactly one ``mlxq: error:`` line naming ``needles``."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mlxq: error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def offline_env(tmp_path: Path) -> dict[str, str]:
    """No hub: an empty Hugging Face cache and offline mode, as on a plane."""
    return {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another process (this one) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def copy_model(tiny_model_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_model_dir, dest)
    return dest


def run_model(model: str, tmp_path: Path, *extra: str, url: str | None = None):
    return run_mlxq(
        "run", PROMPTS, "--model", model, "-o", str(tmp_path / "out.jsonl"), *extra,
        url=url, env=offline_env(tmp_path),
    )  # fmt: skip


def test_a_missing_folder_says_so(tmp_path: Path) -> None:
    proc = run_model("/nonexistent/model", tmp_path)
    assert_one_line(proc, "/nonexistent/model", "no such folder", "mlxq make-model")
    assert "generating" not in proc.stderr  # nothing ran before the check


def test_an_uncached_hub_id_offline_says_how_to_download(tmp_path: Path) -> None:
    repo = "mlx-community/Llama-3.2-1B-Instruct-4bit"
    proc = run_model(repo, tmp_path)
    assert_one_line(proc, repo, "not in the local Hugging Face cache", f"hf download {repo}")


def test_a_folder_without_config_or_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line(run_model(str(empty), tmp_path), "no config.json")
    no_weights = copy_model(tiny_model_dir, tmp_path / "no-weights")
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    assert_one_line(run_model(str(no_weights), tmp_path), "no weights (*.safetensors)")


def test_an_unsupported_architecture_names_its_model_type(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = copy_model(tiny_model_dir, tmp_path / "odd")
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "frobnicator"
    (model / "config.json").write_text(json.dumps(config))
    assert_one_line(run_model(str(model), tmp_path), "'frobnicator'", "not supported by mlx-lm")


def test_corrupt_weights_fail_in_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = copy_model(tiny_model_dir, tmp_path / "corrupt")
    for f in model.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    assert_one_line(run_model(str(model), tmp_path), "could not be loaded", "safetensors")


def test_an_adapter_for_another_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
    # Another model's adapter: every LoRA matrix has the wrong shape for this one.
    weights = mx.load(str(adapter / "adapters.safetensors"))
    mx.save_safetensors(str(adapter / "adapters.safetensors"), {k: v.T for k, v in weights.items()})
    proc = run_model(str(tiny_model_dir), tmp_path, "--adapter-path", str(adapter))
    assert_one_line(proc, "does not fit model", "use an adapter trained for this model")
    (adapter / "adapters.safetensors").unlink()
    proc = run_model(str(tiny_model_dir), tmp_path, "--adapter-path", str(adapter))
    assert_one_line(proc, "has no adapters.safetensors")


def test_a_failed_run_leaves_no_batch(tmp_path: Path, valkey_url: str, conn: redis.Redis) -> None:
    proc = run_model("/nonexistent/model", tmp_path, url=valkey_url)
    assert_one_line(proc, "no such folder")
    assert conn.keys("*") == []


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    proc = run_model("/nonexistent/model", tmp_path, "--log-level", "debug")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ModelError" in proc.stderr


def test_the_worker_checks_its_model_before_serving(
    tmp_path: Path, valkey_url: str, conn: redis.Redis
) -> None:
    proc = run_mlxq(
        "worker", "--model", str(tmp_path / "missing"), "--burst",
        url=valkey_url, env=offline_env(tmp_path),
    )  # fmt: skip
    assert_one_line(proc, "no such folder")
    assert not [k for k in conn.keys("*") if b"worker" in k]  # never registered


def test_a_setting_the_engine_cannot_honour_is_refused(
    tmp_path: Path, tiny_model: str, valkey_url: str
) -> None:
    env = {**offline_env(tmp_path), "MLXQ_SLOT_COMPILE": "1", "MLXQ_SLOT_SORT": "1"}
    proc = run_mlxq("worker", "--model", tiny_model, "--burst", url=valkey_url, env=env)
    assert_one_line(proc, "MLXQ_SLOT_SORT=1 needs the eager decode forward", "MLXQ_SLOT_COMPILE=0")


def test_unreachable_redis(tmp_path: Path, tiny_model: str) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_mlxq("worker", "--model", tiny_model, "--burst", url=f"redis://127.0.0.1:{port}/0")
    assert_one_line(proc, "cannot reach Redis", "mlxq server")


def test_a_busy_metrics_port(tiny_model: str, valkey_url: str, busy_port: int) -> None:
    proc = run_mlxq(
        "worker", "--model", tiny_model, "--burst", "--metrics-port", str(busy_port),
        url=valkey_url,
    )  # fmt: skip
    assert_one_line(proc, f"port {busy_port}", "--metrics-port")


def test_a_busy_server_port(tmp_path: Path, busy_port: int) -> None:
    proc = run_mlxq("server", "--port", str(busy_port), "--data-dir", str(tmp_path / "d"))
    assert_one_line(proc, f"127.0.0.1:{busy_port}", "in use", "--port")


def test_a_busy_api_port(valkey_url: str, busy_port: int) -> None:
    proc = run_mlxq("api", "--port", str(busy_port), "--no-auth", url=valkey_url, timeout=60)
    assert_one_line(proc, f"127.0.0.1:{busy_port}", "in use")


def test_a_bad_profile_file(tmp_path: Path) -> None:
    profile = tmp_path / "bad.toml"
    profile.write_text('model = "m"\nmax_bach = 8\n')
    proc = run_mlxq("worker", "--profile", str(profile), "--burst")
    assert_one_line(proc, "max_bach")


def test_a_missing_extra_names_it(tmp_path: Path, tiny_model: str, valkey_url: str) -> None:
    # A prometheus_client that is not there, as in a plain `pip install mlxq`.
    shadow = tmp_path / "shadow" / "prometheus_client"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'prometheus_client'\", "
        "name='prometheus_client')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    proc = run_mlxq(
        "worker", "--model", tiny_model, "--burst", "--metrics-port", "0",
        url=valkey_url, env=env,
    )  # fmt: skip
    assert_one_line(proc, "`metrics` extra", "pip install -e '.[metrics]' in your mlxq clone")
