"""Worker profiles: every shipped profile loads; typos and bad values name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxq.worker.profile import ProfileError, WorkerProfile, load_profile, merge

WORKERS = Path(__file__).resolve().parent.parent / "workers"


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
