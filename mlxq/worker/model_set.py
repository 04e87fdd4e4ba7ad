"""The models a worker serves and the weights it keeps loaded.

Each model is found (a hub id downloaded) on the calling thread when the worker starts, so
one that cannot be found fails before anything is served. Weights load on the MLX thread
(:meth:`ModelSet.prepare`, handed there by ``Runner``); a worker of several models keeps
the ones it is not running loaded while their weights fit (``model_choice.to_unload``) and
sizes the running one's KV cache from what they leave.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec

from mlxq.engine.hardware import DeviceFacts
from mlxq.engine.models.facts import model_info
from mlxq.engine.models.source import check_adapter, load_model, resolve_model
from mlxq.engine.models.weights import prepare_weights
from mlxq.wire import ModelInfo, WorkerInfo
from mlxq.worker.config import WorkerConfig, resolve
from mlxq.worker.model_choice import to_unload
from mlxq.worker.profile import WorkerProfile
from mlxq.worker.sharing import Starting, share

log = logging.getLogger("mlxq.worker")

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz")


@dataclass
class _Loaded:
    model: Any
    tokenizer: Any
    info: ModelInfo


class ModelSet:
    """The models of a profile (``WorkerProfile.served``), found on disk, loaded on demand."""

    def __init__(self, profile: WorkerProfile) -> None:
        self.profile = profile
        # This host's live workers when this one started, and those still loading then
        # (set by the launcher once it has claimed this worker's memory: ``sharing``).
        self.neighbours: list[WorkerInfo] = []
        self.starting: tuple[Starting, ...] = ()
        self.paths = {m: resolve_model(m) for m in profile.served()}
        if profile.adapter_path is not None:
            check_adapter(profile.adapter_path)
        # Loaded weights, least recently run first: touched on the MLX thread only.
        self._loaded: OrderedDict[str, _Loaded] = OrderedDict()
        self._configs: dict[tuple[str, int], WorkerConfig] = {}

    def prepare(self, name: str, facts: DeviceFacts) -> tuple[Any, Any, WorkerConfig]:
        """(On the MLX thread.) ``name``'s model and tokenizer, loaded unless kept, and its
        configuration beside the weights kept loaded; what does not fit is unloaded first."""
        fraction = self.profile.memory_fraction
        limit = share(facts, fraction, self.neighbours, self.starting).limit_bytes
        if self._loaded and name not in self._loaded:  # room by its size on disk, first
            self._unload(name, limit, _disk_bytes(self.paths[name]))
        loaded = self._loaded.pop(name, None) or self._load(name, facts)
        self._loaded[name] = loaded  # the most recently run, last
        self._unload(name, limit)
        others = sum(m.info.param_bytes for n, m in self._loaded.items() if n != name)
        if (name, others) not in self._configs:  # (resolved once: it logs its choices)
            profile = msgspec.structs.replace(self.profile, model=name)
            config = resolve(profile, facts, loaded.info, self.neighbours, others, self.starting)
            self._configs[name, others] = config
        return loaded.model, loaded.tokenizer, self._configs[name, others]

    def _load(self, name: str, facts: DeviceFacts) -> _Loaded:
        profile = self.profile
        model, tokenizer = load_model(name, self.paths[name], profile.adapter_path)
        model = prepare_weights(model, facts.backend, facts.memory_bytes, profile.dequantize)
        return _Loaded(model, tokenizer, model_info(model, name, vocab_size=len(tokenizer)))

    def _unload(self, name: str, limit: int, incoming: int = 0) -> None:
        """Unload the models that ``name`` (``incoming`` bytes more, if not loaded yet) does
        not leave room for."""
        sizes = {n: m.info.param_bytes for n, m in self._loaded.items()}
        sizes[name] = sizes.get(name, 0) + incoming
        gone = to_unload(name, sizes, limit)
        for n in gone:
            del self._loaded[n]
            log.info("unloaded model %s: its weights do not fit beside %s's", n, name)
        if gone:
            gc.collect()
            mx.clear_cache()


def _disk_bytes(path: Path) -> int:
    """The bytes of a model folder's weight files (its weights' size before loading)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES)
