"""Shared test fixtures: one tiny random model per session, loaded once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from mlxq.make_model import make_model

_cache: dict[str, Any] = {}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the ``tiny`` preset (seed 0), written once per session."""
    if "dir" not in _cache:
        _cache["dir"] = make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")
    return _cache["dir"]


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the tiny model, loaded with ``mlx_lm.load``."""
    if "loaded" not in _cache:
        _cache["loaded"] = mlx_lm.load(str(tiny_model_dir))
    return _cache["loaded"]
