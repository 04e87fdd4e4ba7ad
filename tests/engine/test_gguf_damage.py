"""Damaged GGUF files are refused in one line, never converted into a different model; a
conversion killed midway leaves nothing behind for long (the files: test_gguf's tiny llama,
damaged here byte by byte)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFReader
from helpers import ROOT, run_mlxq
from test_gguf import write_tiny_gguf

from mlxq.engine.models import gguf as gguf_model
from mlxq.engine.models.gguf_checks import FIX
from mlxq.engine.models.source import ModelError, resolve_model

PROMPTS = str(ROOT / "examples" / "prompts.jsonl")


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv(gguf_model.CACHE_ENV, str(cache))
    return cache


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama as a float32 GGUF: 21 tensors, 18 keys."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


class File:
    """A good file's bytes and where its header keeps each field, to damage them."""

    def __init__(self, path: Path) -> None:
        self.data = path.read_bytes()
        self.reader = GGUFReader(str(path))
        self.names = [t.name for t in self.reader.tensors]

    def put(self, at: int, fmt: str, value: float) -> bytes:
        data = bytearray(self.data)
        struct.pack_into("<" + fmt, data, at, value)
        return bytes(data)

    def dims_at(self, i: int) -> int:
        """Where tensor ``i``'s first dimension is."""
        t = self.reader.tensors[i]
        return t.field.offset + 8 + len(t.name.encode()) + 4

    def offset_at(self, i: int) -> int:
        """Where tensor ``i``'s data offset is."""
        return self.dims_at(i) + 8 * len(self.reader.tensors[i].shape) + 4

    def offset(self, i: int) -> int:
        return self.reader.tensors[i].data_offset - self.reader.data_offset

    def value_at(self, key: str) -> int:
        """Where key ``key``'s (scalar) value is."""
        return self.reader.fields[key].offset + 8 + len(key.encode()) + 4

    def random(self, start: int, n: int) -> bytes:
        noise = np.random.default_rng(start).integers(0, 256, n, dtype=np.uint8).tobytes()
        return self.data[:start] + noise + self.data[start + n :]


KEYS = 18  # the tiny file's metadata keys
# name: (how the file is damaged, what its one line must name)
DAMAGES: dict[str, tuple[Callable[[File], bytes], tuple[str, ...]]] = {
    "shape changed": (
        lambda f: f.put(f.dims_at(0), "Q", 32),
        ("tensor 'token_embd.weight' has shape [32, 512]", "expected [64, 512]"),
    ),
    "data offset moved": (
        lambda f: f.put(f.offset_at(3), "Q", f.offset(3) + 64),
        ("tensor 'blk.0.attn_v.weight'", "expected 155,648"),
    ),
    "overlapping ranges": (
        lambda f: f.put(f.offset_at(2), "Q", f.offset(1)),
        ("tensor 'blk.0.attn_k.weight'", "inside the data of tensor 'blk.0.attn_q.weight'"),
    ),
    "tensor_count huge": (
        lambda f: f.put(8, "Q", 2**40),
        ("tensor_count is 1,099,511,627,776", "holds at most"),
    ),
    "tensor_count one short": (
        lambda f: f.put(8, "Q", 20),
        ("tensor_count (20)", "bytes follow the last tensor's data"),
    ),
    "kv_count huge": (lambda f: f.put(16, "Q", 2**40), ("kv_count is 1,099,511,627,776",)),
    "kv_count one more": (
        lambda f: f.put(16, "Q", KEYS + 1),
        ("the name of tensor #1 of 21", f"{KEYS + 1} keys: is a count wrong?"),
    ),
    "kv_count one short": (
        lambda f: f.put(16, "Q", KEYS - 1),
        ("tensor 'tokenizer.chat_template' (#1 of 21) has 8 dimensions, expected 1 to 4",),
    ),
    "truncated": (
        lambda f: f.data[:-100],
        ("tensor 'output.weight' ends at byte 571,296", "it is truncated"),
    ),
    "truncated in the header": (lambda f: f.data[:500], ("tensor_count is 21",)),
    "zero bytes": (lambda f: b"", ("the file has 0 bytes",)),
    "random header bytes": (lambda f: f.random(24, 64), ("the name of key #1 of 18",)),
    "random counts": (lambda f: f.random(8, 16), ("tensor_count is",)),
    "magic": (lambda f: b"GGUG" + f.data[4:], ("b'GGUG', not GGUF's magic",)),
    "block_count": (
        lambda f: f.put(f.value_at("llama.block_count"), "I", 3),
        ("tensor 'blk.2.attn_norm.weight' is missing", "'llama.block_count' is 3"),
    ),
    "tensor renamed": (
        lambda f: f.data.replace(b"blk.1.attn_q.weight", b"blk.1.attn_a.weight"),
        ("tensor 'blk.1.attn_a.weight' is not one of a llama model's tensors",),
    ),
    "norm epsilon NaN": (
        lambda f: f.put(f.value_at("llama.attention.layer_norm_rms_epsilon"), "f", float("nan")),
        ("key 'llama.attention.layer_norm_rms_epsilon' is nan",),
    ),
}


def refusal(path: Path, cache: Path) -> str:
    """``path`` is refused with one line naming it and saying what to do; nothing loads,
    nothing is left in the cache."""
    with pytest.raises(ModelError) as e:
        resolve_model(str(path))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"model {path}: ") and line.endswith(FIX), line
    assert not list(cache.glob("*")), list(cache.glob("*"))
    return line


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_gguf_is_refused_in_one_line_naming_what_is_wrong(
    damage: str, good: Path, tmp_path: Path, gguf_cache: Path
) -> None:
    how, needles = DAMAGES[damage]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(how(File(good)))
    line = refusal(path, gguf_cache)
    for needle in needles:
        assert needle in line, line


def test_what_the_reader_still_raises_becomes_one_line_with_its_cause(
    good: Path, gguf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(path: str) -> None:
        raise IndexError("index 0 is out of bounds for axis 0 with size 0")

    monkeypatch.setattr(gguf, "GGUFReader", broken)
    line = refusal(good, gguf_cache)
    assert "gguf's reader cannot read it (IndexError: index 0 is out of bounds" in line
    with pytest.raises(ModelError) as e:
        resolve_model(str(good))
    assert isinstance(e.value.__cause__.__cause__, IndexError)


def test_a_changed_float_in_the_metadata_is_not_caught(good: Path, tmp_path: Path) -> None:
    """No checksum: a plausible rope theta, changed, loads (docs/gguf.md says so)."""
    file = File(good)
    path = tmp_path / "theta.gguf"
    path.write_bytes(file.put(file.value_at("llama.rope.freq_base"), "f", 20000.0))
    config = json.loads((resolve_model(str(path)) / "config.json").read_text())
    assert config["rope_theta"] == 20000.0


def test_mlxq_run_on_a_damaged_gguf_exits_non_zero_with_one_line(
    good: Path, tmp_path: Path, gguf_cache: Path
) -> None:
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    file = File(good)
    damaged = {"shape": file.put(file.dims_at(0), "Q", 32), "noise": file.random(8, 80)}
    for name, data in damaged.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        out = str(tmp_path / "out.jsonl")
        proc = run_mlxq("run", PROMPTS, "--model", str(path), "-o", out, env=env)
        assert proc.returncode != 0, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mlxq: error:")]
        assert len(lines) == 1 and f"model {path}: " in lines[0] and FIX in lines[0], proc.stderr
    assert not list(gguf_cache.glob("*"))


def test_a_killed_conversions_folder_is_removed_by_the_next_one_a_live_ones_kept(
    good: Path, gguf_cache: Path
) -> None:
    # A real conversion, killed once it has written 1 MiB into its work folder.
    code = (
        "import os, signal, sys; from pathlib import Path\n"
        "from mlxq.engine.models import gguf\n"
        "def die(path, work):\n"
        "    (work / 'model.safetensors').write_bytes(bytes(1 << 20))\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "gguf.write_folder = die\n"
        "gguf.converted_folder(Path(sys.argv[1]))\n"
    )
    env = {**os.environ, gguf_model.CACHE_ENV: str(gguf_cache)}
    proc = subprocess.run([sys.executable, "-c", code, str(good)], cwd=ROOT, env=env, check=False)
    assert proc.returncode == -signal.SIGKILL
    [dead] = gguf_cache.glob(".converting-*")
    dead_pid = dead.name.split("-")[2]
    assert dead.name.startswith(f".converting-{gguf_model.host_tag()}-{dead_pid}-")
    live = gguf_cache / f".converting-{gguf_model.host_tag()}-{os.getpid()}-live"
    other_host = gguf_cache / f".converting-elsewhere-{dead_pid}-x"  # its pid means nothing here
    # Named before pids were: removed once a day old.
    unowned_old, unowned_new = gguf_cache / ".converting-ab_1", gguf_cache / ".converting-cd_2"
    for folder in (live, other_host, unowned_old, unowned_new):
        folder.mkdir()
    day_ago = time.time() - gguf_model.UNOWNED_STALE_S - 60
    os.utime(unowned_old, (day_ago, day_ago))
    folder = resolve_model(str(good))
    assert not dead.exists() and not unowned_old.exists()
    assert sorted(p.name for p in gguf_cache.iterdir()) == sorted(
        [live.name, other_host.name, unowned_new.name, folder.name]
    )
