"""MLX's CPU kernels built one process at a time (mlxq.engine.kernel_lock), and the
softmax's and the SiLU's warm-ups building every kernel their users evaluate later (no
kernel is built outside the lock afterwards)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlxq.engine.kernel_lock import building_kernels

WAITER = """
import sys
from mlxq.engine.kernel_lock import building_kernels
print("waiting", flush=True)
with building_kernels():
    print("holding", flush=True)
"""


def test_a_second_process_waits_for_the_lock(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # (read TMPDIR again)
    with building_kernels(), building_kernels():  # (re-entrant in one process)
        waiter = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, text=True)
        assert waiter.stdout is not None
        assert waiter.stdout.readline() == "waiting\n"
        with pytest.raises(subprocess.TimeoutExpired):
            waiter.wait(timeout=1)  # (it cannot take the lock while this process holds it)
    out, _ = waiter.communicate(timeout=60)
    assert out == "holding\n" and waiter.returncode == 0
    assert (tmp_path / "mlx" / "mlxq-kernels.lock").exists()


ATTEND = """
import itertools, os
import mlx.core as mx
mx.set_default_device(mx.cpu)
from mlxq.engine.slots import silu, softmax
from mlxq.engine.slots.attention import gqa_decode

def kernels():
    return {p.name for p in __import__("pathlib").Path(os.environ["TMPDIR"]).rglob("*.so")}

softmax.warm_up()
silu.warm_up()
built = kernels()
print(len(built))
for rows, span, heads, kv in itertools.product((1, 5, 128), (1, 9, 300), (1, 9), (1, 3)):
    if heads < kv:
        continue
    q = mx.random.normal((rows, heads, 1, 8))
    k, v = (mx.random.normal((rows, kv, span, 8)) for _ in range(2))
    mask = mx.arange(span)[None, None, None] < mx.arange(1, rows + 1)[:, None, None, None]
    mx.eval(gqa_decode(q, k, v, 0.3, mask, softmax.pow2_softmax))
    for block in (1, 7):
        qb = mx.random.normal((1, heads, min(block, span), 8))
        mx.eval(softmax.causal_attention(qb, k[:1], v[:1], 0.3, softmax.pow2_softmax))
for rows, tokens, width in itertools.product((1, 5, 128), (1, 7), (1, 64, 1536)):
    gate, up = (mx.random.normal((rows, tokens, width)) for _ in range(2))
    wide = mx.random.normal((rows, tokens, 2 * width))
    mx.eval(silu.pow2_swiglu(gate, up), silu.pow2_swiglu(wide[..., :width], wide[..., width:]))
print(sorted(kernels() - built))
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="MLX builds CPU kernels with g++")
def test_the_warm_ups_build_every_kernel_the_attention_and_the_mlp_evaluate(tmp_path) -> None:
    """In a fresh kernel folder: the decode attention over one row or many, of one
    position or many, one query head or several over one KV head or several, prefill
    blocks of one query row or several, and the SiLU over inputs whole or as views, of
    every size, build nothing after the warm-ups."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ATTEND)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    built, after = run.stdout.splitlines()
    assert int(built) >= 5  # (the power's two, the softmax's and the SiLU's, built here)
    assert after == "[]"
    assert any(Path(tmp_path, "mlx").rglob("*.so"))


UNCOMPILED = """
import os, pathlib
import mlx.core as mx
mx.set_default_device(mx.cpu)
from mlxq.engine.slots.softmax import mlx_softmax, pow2_softmax
scores = mx.random.normal((16, 3, 3, 200)) * 4
mask = mx.arange(200) >= 5
got, want = (
    s.attend(scores * s.query_scale(1.0), mask, lambda w: w) for s in (pow2_softmax, mlx_softmax)
)
built = list(pathlib.Path(os.environ["TMPDIR"]).rglob("*.so"))
print(mx.abs(got - want).max().item(), len(built))
"""


def test_without_mlx_s_compiler_the_softmax_runs_op_by_op(tmp_path) -> None:
    """Where MLX cannot compile (no C++ compiler; here ``MLX_DISABLE_COMPILE``), the same
    operations run one by one: the same weights, nothing built."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "MLX_DISABLE_COMPILE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", UNCOMPILED], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    difference, built = run.stdout.split()
    assert float(difference) <= 1e-6 and built == "0"
