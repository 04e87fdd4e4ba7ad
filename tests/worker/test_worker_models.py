"""A worker of several models, below the process level: how profiles and flags name the
models, which queues each model pulls from, what it publishes, and the MLX thread building
the next model's engine while the caller goes on (``Runner.replace``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from mlxq.cli.fleet import format_workers
from mlxq.engine.runner import Runner
from mlxq.errors import StartupError
from mlxq.wire import ModelInfo, WorkerInfo
from mlxq.worker.config import queues_by_model, worker_queues
from mlxq.worker.profile import ProfileError, WorkerProfile, load_profile, merge
from mlxq.worker.watchdog import step_age
from tests.helpers import worker_record


def test_a_profile_names_several_models_and_the_first_loads_first(tmp_path: Path):
    path = tmp_path / "two.toml"
    path.write_text('models = ["org/alpha", "org/beta"]\nmin_model_seconds = 5\n')
    profile = load_profile(path)
    assert (profile.model, profile.served(), profile.min_model_seconds) == (
        "org/alpha",
        ["org/alpha", "org/beta"],
        5,
    )
    path.write_text('model = "org/beta"\nmodels = ["org/alpha", "org/beta"]\n')
    assert load_profile(path).model == "org/beta"  # the one named loads first
    path.write_text('model = "org/gamma"\nmodels = ["org/alpha", "org/beta"]\n')
    with pytest.raises(ProfileError, match=r"two.toml.*gamma.*is not one of models"):
        load_profile(path)
    path.write_text('models = ["a", "a"]\n')
    with pytest.raises(ProfileError, match="names a model twice"):
        load_profile(path)


def test_repeated_model_flags_replace_the_profiles_models():
    base = WorkerProfile(models=["a", "b", "c"])
    assert merge(base, {"model": ()}).served() == ["a", "b", "c"]  # not given
    assert merge(base, {"model": ("x", "y")}).served() == ["x", "y"]
    one = merge(base, {"model": ("x",)})
    assert (one.model, one.models, one.served()) == ("x", [], ["x"])
    assert merge(WorkerProfile(model="a"), {"model": "b"}).served() == ["b"]


def test_an_adapter_belongs_to_one_model():
    with pytest.raises(ProfileError, match="an adapter belongs to one model"):
        merge(WorkerProfile(model="a", adapter_path="/ad"), {"model": ("a", "b")})


def test_each_model_pulls_its_own_queue_and_the_shared_ones():
    two = WorkerProfile(models=["org/alpha", "beta.gguf"])
    assert worker_queues(two) == ("alpha", "beta", "default")
    assert queues_by_model(two) == {
        "org/alpha": ("alpha", "default"),
        "beta.gguf": ("beta", "default"),
    }
    named = merge(two, {"queues": ["urgent", "beta", "bulk"]})
    assert queues_by_model(named) == {
        "org/alpha": ("urgent", "bulk"),
        "beta.gguf": ("urgent", "beta", "bulk"),
    }
    assert worker_queues(WorkerProfile(model="org/alpha")) == ("alpha", "default")


def test_two_models_of_one_queue_name_are_refused():
    with pytest.raises(StartupError, match="share a queue name"):
        queues_by_model(WorkerProfile(models=["org1/m", "org2/m"]))


def _info(**fields: Any) -> WorkerInfo:
    return worker_record(
        model="org/alpha",
        queues=["alpha", "beta", "default"],
        memory_bytes=2**34,
        max_batch=8,
        kv_budget_bytes=2**30,
        **fields,
    )


def test_worker_records_list_their_models_and_old_records_still_read():
    old = msgspec.to_builtins(_info())
    del old["models"]  # as a worker before several models published it
    assert msgspec.json.decode(msgspec.json.encode(old), type=WorkerInfo).models == []
    both = _info(models=["org/alpha", "org/beta"], state="switching")
    row = format_workers([both], now=0).splitlines()[1]
    assert "alpha (+beta)" in row and "w1 [switching]" in row
    assert "(+" not in format_workers([_info()], now=0)


class _Engine:
    """Just enough of a BatchEngine for the MLX thread's idle loop."""

    def __init__(self, name: str) -> None:
        self.info = ModelInfo(name, "llama", 1, 8, 1, 8, 16, 64, 8, 1024, "float32")
        self.active, self.closed = 0, False

    def close(self) -> None:
        self.closed = True

    def step(self) -> list[Any]:
        return []

    def take_stream(self) -> list[Any]:
        return []


def test_the_next_engine_is_built_on_the_mlx_thread_while_the_caller_goes_on():
    first = _Engine("a")
    runner = Runner(lambda facts: first, lambda engine, facts: "scheduler a")  # type: ignore[arg-type,return-value]
    runner.start()
    release, built_on = threading.Event(), []

    def build(facts: Any) -> Any:
        built_on.append(threading.current_thread().name)
        release.wait(30)
        return _Engine("b"), "scheduler b"

    try:
        loading = runner.replace(build)
        assert not loading.done()  # building, on the other thread
        assert runner.completions(timeout=0.05) == []  # the caller goes on meanwhile
        assert runner.scheduler == "scheduler a"  # read by the worker's reports meanwhile
        release.set()
        assert loading.result(30).name == "b"
        assert built_on == ["mlxq-mlx"] and first.closed
        assert runner.engine.info.name == "b" and runner.scheduler == "scheduler b"
        assert runner.alive
    finally:
        runner.stop()


def test_an_engine_with_jobs_is_not_replaced():
    engine = _Engine("a")
    engine.active = 1  # a job decoding
    runner = Runner(lambda facts: engine, lambda engine, facts: "scheduler")  # type: ignore[arg-type,return-value]
    runner.start()
    try:
        with pytest.raises(RuntimeError, match="still has jobs"):
            runner.replace(lambda facts: (_Engine("b"), "other")).result(30)  # type: ignore[arg-type,return-value]
        assert runner.engine is engine and not engine.closed and runner.alive
    finally:
        runner.stop()


def test_the_mlx_thread_counts_only_the_time_it_had_no_job_as_idle():
    idle, busy = _Engine("idle"), _Engine("busy")
    busy.active = 1  # a job decoding: the thread steps on, never waiting on its inbox
    runners = [Runner(lambda facts, e=e: e, lambda engine, facts: "s") for e in (idle, busy)]  # type: ignore[misc,arg-type,return-value]
    for runner in runners:
        runner.start()
    try:
        time.sleep(0.5)
    finally:
        for runner in runners:
            runner.stop()
    assert runners[0].idle_seconds >= 0.3 and runners[1].idle_seconds == 0.0


def test_a_ping_to_other_ranks_that_hangs_is_work_the_stall_watchdog_sees():
    engine, release = _Engine("ranks"), threading.Event()
    engine.idle = lambda: release.wait(30)  # type: ignore[attr-defined]  # a rank gone
    runner = Runner(lambda facts: engine, lambda engine, facts: "s")  # type: ignore[arg-type,return-value]
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while not runner.holds_work:  # no job, yet the MLX thread is stuck in a native call
            assert time.monotonic() < deadline, "the hung ping was not counted"
            time.sleep(0.01)
        assert step_age(runner, {}) is not None
        release.set()
        while runner.holds_work:
            assert time.monotonic() < deadline, "a finished ping still counted"
            time.sleep(0.01)
    finally:
        release.set()
        runner.stop()


def test_a_step_that_hangs_after_its_last_rows_ended_is_work_the_stall_watchdog_sees():
    """As a pipeline's step that empties the batch, then clears MLX's cache, which waits
    on a stream with a send to a rank that is gone."""
    engine, entered, release = _Engine("ranks"), threading.Event(), threading.Event()
    engine.active = 1

    def step() -> list[Any]:
        engine.active = 0  # its last rows ended
        entered.set()
        release.wait(30)
        return []

    engine.step = step  # type: ignore[method-assign]
    runner = Runner(lambda facts: engine, lambda engine, facts: "s")  # type: ignore[arg-type,return-value]
    runner.start()
    try:
        assert entered.wait(10)
        assert runner.holds_work and step_age(runner, {}) is not None
    finally:
        release.set()
        runner.stop()
