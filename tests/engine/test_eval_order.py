"""MLX's evaluation order on the CPU (mlxq.engine.eval_order): the setting, and that MLX
honours it where it is set before anything evaluates (the tests' own process, as the
worker's).

Which order MLX chose shows in its peak memory, not in time: 64 independent branches, each
a 1 MiB array reduced to one number. Laid out level by level, all 64 arrays are made
before any is reduced; depth first, past MLX's default width of 20, a branch is reduced
before the next ones start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from mlxq.engine.eval_order import CPU_WIDTH, WIDTH_ENV, widen
from mlxq.engine.hardware import backend_name

BRANCHES, MIB = 64, 1 << 20

# The branches, as source: run in a fresh process and in this one.
PROBE = """
import mlx.core as mx

def peak_of(branches):
    base = mx.zeros((1 << 18,), stream=mx.cpu)
    mx.eval(base)
    mx.reset_peak_memory()
    with mx.stream(mx.cpu):
        out = mx.stack([mx.exp(base + i).sum() for i in range(branches)]).sum()
    mx.eval(out)
    return mx.get_peak_memory()
"""


def peak_of_branches(width: str | None) -> int:
    """MLX's peak bytes over the branches in a fresh process, MLX_BFS_MAX_WIDTH as given
    (None: widened as the worker does)."""
    env = {k: v for k, v in os.environ.items() if k != WIDTH_ENV}
    if width is not None:
        env[WIDTH_ENV] = width
    setup = "from mlxq.engine.eval_order import widen\nwiden('cpu')\n"
    out = subprocess.run(
        [sys.executable, "-c", setup + PROBE + f"print(peak_of({BRANCHES}))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.split()[-1])


def test_the_cpu_is_widened_and_mlx_honours_it() -> None:
    """Widened, the 64 branches' arrays are all alive at once; at MLX's default (a user's
    20), a third of them at most."""
    assert peak_of_branches(None) >= BRANCHES * MIB
    assert peak_of_branches("20") <= BRANCHES * MIB // 2


@pytest.mark.skipif(backend_name() != "cpu", reason="the CPU's evaluation order")
def test_the_tests_evaluate_in_the_worker_s_order() -> None:
    """This process (conftest widens it first, as `mlxq worker` does) lays out wide."""
    probe: dict[str, Any] = {}
    exec(PROBE, probe)
    assert probe["peak_of"](BRANCHES) >= BRANCHES * MIB


def test_width_settings(monkeypatch) -> None:
    monkeypatch.delenv(WIDTH_ENV, raising=False)
    widen("metal")
    widen("cuda")
    assert WIDTH_ENV not in os.environ
    widen("cpu")
    assert os.environ[WIDTH_ENV] == str(CPU_WIDTH)
    monkeypatch.setenv(WIDTH_ENV, "64")
    widen("cpu")
    assert os.environ[WIDTH_ENV] == "64"  # (the user's kept)
    for bad in ("", "0", "wide", "-3"):
        monkeypatch.setenv(WIDTH_ENV, bad)
        with pytest.raises(ValueError, match=f"{WIDTH_ENV}=.*whole number"):
            widen("cpu")
