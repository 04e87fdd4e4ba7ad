"""Worker profiles: every shipped profile loads; typos and bad values name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxq.worker.profile import ProfileError, WorkerProfile, load_profile, merge

WORKERS = Path(__file__).resolve().parents[2] / "workers"


@pytest.mark.parametrize("path", sorted(WORKERS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_profiles_load(path: Path):
    profile = load_profile(path)
    assert profile.model and profile.queues


def test_unknown_keys_and_bad_values_name_the_file_and_key(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "m"\nmax_batchh = 4\n')
    with pytest.raises(ProfileError, match=r"bad.toml.*max_batchh"):
        load_profile(bad)
    bad.write_text('model = "m"\nmemory_fraction = 1.5\n')
    with pytest.raises(ProfileError, match=r"memory_fraction"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="no such profile"):
        load_profile(tmp_path / "missing.toml")


def test_flags_override_the_profile():
    base = WorkerProfile(model="a", max_batch=8, queues=["q"])
    merged = merge(base, {"model": None, "max_batch": 32, "queues": []})
    assert (merged.model, merged.max_batch, merged.queues) == ("a", 32, ["q"])


def test_flags_are_held_to_the_profiles_limits():
    with pytest.raises(ProfileError, match=r"prefill_step"):
        merge(WorkerProfile(model="a"), {"prefill_step": 4})


def test_a_split_without_hosts_is_refused(tmp_path: Path):
    """backend and parallel only mean something with hosts: never ignored silently."""
    with pytest.raises(ProfileError, match=r"parallel split a model over several hosts"):
        merge(WorkerProfile(model="a"), {"parallel": "pipeline"})
    bad = tmp_path / "split.toml"
    bad.write_text('model = "m"\nbackend = "jaccl"\n')
    with pytest.raises(ProfileError, match=r"split.toml.*give hosts too"):
        load_profile(bad)
    assert merge(WorkerProfile(model="a"), {"hosts": ["a", "b"], "parallel": "tensor"})


def _facts(backend: str, gib: int = 16):
    from mlxq.engine.hardware import DeviceFacts

    return DeviceFacts(backend, "dev", gib * 2**30, gib * 2**30, "host", "os")


def _info(param_bytes: int = 2**30, kv_per_token: int = 2**15):
    from mlxq.wire import ModelInfo

    return ModelInfo(
        "org/m", "llama", 16, 2048, 8, 64, 1000, 8192, kv_per_token, param_bytes, "f16"
    )


def test_one_resolved_configuration_decides_every_automatic_setting():
    from mlxq.worker.config import resolve

    config = resolve(WorkerProfile(model="org/m"), _facts("metal"), _info())
    budget = int(16 * 2**30 * 0.75) - 2**30  # 75% of memory less the weights
    assert config.prefix_cache_bytes == int(budget * 0.1)
    assert config.kv_budget_bytes == budget - config.prefix_cache_bytes
    # Metal's ceiling: the budget holds more rows than that of short jobs (admission and
    # pulls then go by the jobs' real lengths).
    assert config.max_batch == 512 and config.batch.limit == "backend ceiling"
    assert config.auto_prefill and config.queues == ("m", "default")
    assert (config.stall_timeout, config.abandon_after, config.grace_period) == (300, 30, 60)
    assert resolve(WorkerProfile(model="m"), _facts("cpu"), _info()).stall_timeout == 1800
    given = WorkerProfile(model="m", max_batch=3, prefill_batch=2, stall_timeout=9, queues=["x"])
    config = resolve(given, _facts("cpu"), _info())
    assert (config.max_batch, config.prefill_batch, config.auto_prefill) == (3, 2, False)
    assert (config.stall_timeout, config.queues, config.prefill_tokens) == (9, ("x",), 2048)


def test_a_quantized_kv_cache_sizes_batches_on_its_own_bytes():
    from mlxq.engine.scheduler import kv_group_size, quantized_kv_bytes
    from mlxq.worker.config import resolve

    # 16 layers x 8 KV heads x 64 x (K, V) x 2 bytes: 32 KiB a token in float16.
    assert quantized_kv_bytes(2**15, "float16", 64, 8) == 2**14 + 2**14 // 64 * 4
    assert quantized_kv_bytes(2**15, "bfloat16", 64, 4) == 2**13 + 2**14 // 64 * 4
    assert (kv_group_size(128), kv_group_size(96), kv_group_size(16)) == (64, 32, None)
    facts, info = _facts("metal", gib=64), _info()
    plain = resolve(WorkerProfile(model="m"), facts, info)
    eight = resolve(WorkerProfile(model="m", kv_bits=8), facts, info)
    assert eight.kv_bits == 8 and eight.info.kv_bytes_per_token == 17408
    assert plain.max_batch == eight.max_batch == 512  # both at Metal's ceiling
    small = _facts("metal", gib=2)  # where memory, not the cap, sets the batch
    ratio = (
        resolve(WorkerProfile(model="m", kv_bits=8), small, info).max_batch
        / resolve(WorkerProfile(model="m"), small, info).max_batch
    )
    assert 1.8 < ratio < 2.0
    with pytest.raises(ProfileError, match="kv_bits"):
        merge(WorkerProfile(model="m"), {"kv_bits": 5})


def test_the_batch_choice_is_logged_in_one_line_and_reaches_the_engine(caplog):
    import logging

    from mlxq.engine.scheduler import BATCH_CEILING
    from mlxq.worker.config import resolve

    h200 = _facts("cuda", gib=140)
    with caplog.at_level(logging.INFO, logger="mlxq.worker"):
        wide = resolve(WorkerProfile(model="m"), h200, _info())
        small = resolve(WorkerProfile(model="m"), _facts("cuda", gib=2), _info())
        given = resolve(WorkerProfile(model="m", max_batch=300), h200, _info())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch ")]
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert lines[0].startswith(f"batch up to {BATCH_CEILING['cuda']:,}: the cuda ceiling")
    assert lines[1].startswith(f"batch up to {small.max_batch}: memory (a KV budget of")
    assert lines[2].startswith("batch 300: set by --max-batch")
    assert (wide.batch.limit, small.batch.limit, given.batch.limit) == (
        "backend ceiling",
        "memory",
        "--max-batch",
    )
    # The engine holds as many rows as the scheduler admits (and 256 when fewer: its join
    # pacing as before); --max-batch sets both.
    assert wide.engine_max_batch == wide.max_batch == BATCH_CEILING["cuda"]
    assert small.max_batch < 256 == small.engine_max_batch
    assert given.engine_max_batch == given.max_batch == 300
