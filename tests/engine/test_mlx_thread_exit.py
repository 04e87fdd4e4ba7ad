"""A process whose MLX thread ran compiled functions exits cleanly.

MLX's compile cache is per thread and holds Python objects. Freed by the thread's own exit,
it takes the GIL; when the main thread is already finalizing by then, the process aborts
(``terminate called without an active exception``, exit 134) after doing all its work. The
race is lost about one exit in four without the MLX thread's cleanup, so a few processes
run here, each as a script that stops its runner and exits at once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from mlxq.engine.runner import Runner

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import mlx.core as mx
    from mlxq.engine.runner import Runner

    @mx.compile
    def twice(x):
        return x * 2

    class Engine:
        active = 0
        info = None

        def close(self):
            pass

    def make(facts):
        mx.eval(twice(mx.ones(4)))  # traced on the MLX thread: its cache holds the trace
        return Engine()

    runner = Runner(make, lambda engine, facts: None)
    runner.start()
    runner.stop()
    """
)


class _Engine:
    active = 0
    info = None
    closed = False

    def close(self) -> None:
        self.closed = True


def test_processes_that_stop_their_mlx_thread_and_exit_at_once_exit_zero() -> None:
    for _wave in range(2):  # eight in all, four at a time: the race needs no particular load
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", SCRIPT],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            assert "terminate called" not in err


def test_the_mlx_thread_clears_its_streams_last(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, bool]] = []
    engine = _Engine()
    real = mx.clear_streams

    def clear() -> None:
        calls.append((threading.current_thread().name, engine.closed))
        real()

    monkeypatch.setattr(mx, "clear_streams", clear)
    runner = Runner(lambda facts: engine, lambda engine, facts: None)  # type: ignore[arg-type,return-value]
    runner.start()
    runner.stop()
    assert calls == [("mlxq-mlx", True)] and not runner._thread.is_alive()


def test_an_mlx_thread_whose_engine_failed_to_start_clears_its_streams_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    real = mx.clear_streams
    monkeypatch.setattr(mx, "clear_streams", lambda: (calls.append("clear"), real()))

    def fail(facts: object) -> _Engine:
        raise RuntimeError("no such model")

    runner = Runner(fail, lambda engine, facts: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(Exception, match="no such model"):
        runner.start()
    runner.stop()
    assert calls == ["clear"]
