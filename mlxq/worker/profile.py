"""Worker profiles: one TOML file per kind of machine (``workers/NAME.toml``).

A profile names the model, queues and limits a worker runs with; command-line flags
override it. Unknown keys are errors, so a typo does not silently fall back to a default.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from mlxq.broker import keys


class WorkerProfile(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Settings of one worker; None means "decide automatically".

    ``model`` is the model it serves, or, with ``models`` (several), the one it loads first
    (the first of ``models`` unless named); see :mod:`mlxq.worker.model_choice` for how a
    worker of several models switches between them."""

    model: str | None = None
    models: list[str] = []
    queues: list[str] = []
    adapter_path: str | None = None
    max_batch: Annotated[int, Meta(ge=1, le=4096)] | None = None
    # Prompts prefilled together; None sizes it from the waiting prompts' lengths.
    prefill_batch: Annotated[int, Meta(ge=1, le=4096)] | None = None
    prefill_step: Annotated[int, Meta(ge=16, le=65536)] = 2048
    memory_fraction: Annotated[float, Meta(gt=0.0, le=0.95)] = 0.75
    # Share of the KV budget kept for shared-prefix caches (system prompts, few-shot
    # preambles); 0 turns prefix reuse off.
    prefix_cache_fraction: Annotated[float, Meta(ge=0.0, le=0.5)] = 0.1
    # Seconds without a heartbeat after which other workers take this one's jobs back.
    abandon_after: Annotated[int, Meta(ge=3, le=3600)] = 30
    grace_period: Annotated[float, Meta(ge=0.0)] = 60.0
    # Seconds the MLX thread may go without completing a step while jobs are in flight
    # before the worker puts them back and exits non-zero; None: by backend (see config).
    stall_timeout: Annotated[float, Meta(ge=1.0)] | None = None
    name: str | None = None
    # Jobs whose payload inflates past this many bytes fail alone, unread.
    max_job_bytes: Annotated[int, Meta(ge=1024)] = keys.MAX_JOB_BYTES
    # A result larger than this (or than the server's limits) fails its job instead of
    # being written: Redis refuses a bulk string past proto-max-bulk-len (512 MB).
    max_result_bytes: Annotated[int, Meta(ge=1024 * 1024)] = 64 * 1024 * 1024
    # The batch engine: None runs the slot engine where the model's cache allows it.
    engine: Literal["slot", "batch_generator"] | None = None
    # Store the slot KV cache quantized to 8 or 4 bits (8: about half the memory of
    # bfloat16, so about twice the batch); None keeps the model's dtype.
    kv_bits: Literal[8, 4] | None = None
    # Quantized weights: "auto" dequantizes them at load on CUDA when they fit, and on the
    # CPU when a timed layer says it is faster (MLX's CPU quantized matmul is slow).
    dequantize: Literal["auto", "on", "off"] = "auto"
    # Serve Prometheus metrics on this port (needs the `metrics` extra).
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    # One worker over several hosts (rank 0, this one, first): the model split by heads
    # (tensor) or by layers (pipeline) through MLX's distributed backend
    # (mlxq.worker.distributed_launch); "auto" picks by backend (mlxq.engine.distributed.split).
    hosts: Annotated[list[str], Meta(min_length=2)] = []
    backend: Literal["ring", "jaccl"] = "ring"
    parallel: Literal["auto", "tensor", "pipeline"] = "auto"
    # With several models: seconds a model stays loaded while its queues have work before
    # another model's waiting jobs take the worker (bounds switching back and forth).
    min_model_seconds: Annotated[float, Meta(ge=0.0)] = 60.0
    # macOS: hold off idle sleep while the worker holds jobs (mlxq.worker.keep_awake);
    # does nothing on other systems.
    keep_awake: bool = True

    def __post_init__(self) -> None:
        if not self.hosts and (self.backend != "ring" or self.parallel != "auto"):
            raise ValueError(
                "backend and parallel split a model over several hosts: give hosts too "
                "(--hosts A,B), or leave them out"
            )
        if not self.models:
            return
        if len(set(self.models)) < len(self.models):
            raise ValueError(f"models: {self.models} names a model twice; name each once")
        if self.model is None:
            self.model = self.models[0]
        elif self.model not in self.models:
            raise ValueError(
                f"model: {self.model!r} is not one of models {self.models}; give `models` "
                "alone (the first loads first) or a `model` among them"
            )
        if self.adapter_path is not None and len(self.models) > 1:
            raise ValueError(
                "adapter_path: an adapter belongs to one model, and this worker serves "
                f"{len(self.models)}; run a worker per adapter"
            )

    def served(self) -> list[str]:
        """Every model this worker serves (``models``, else ``model``; empty if none)."""
        return list(self.models) or ([self.model] if self.model else [])


DEFAULTS = WorkerProfile()  # the one place worker defaults are written
# Seconds without an engine step (jobs in flight) before a worker gives up on its MLX
# thread, when the profile does not say: enough for a first compile and a long prefill on
# a GPU; the CPU backend (development, CI) can take minutes per step of a real model.
STALL_TIMEOUT_S = {"metal": 300.0, "cuda": 300.0, "cpu": 1800.0}


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the key."""


def load_profile(path: str | Path) -> WorkerProfile:
    """Read and validate a worker profile TOML file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise ProfileError(f"{path}: no such profile (see workers/ for examples)") from e
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML: {e}") from e
    try:
        return msgspec.convert(data, WorkerProfile)
    except msgspec.ValidationError as e:
        raise ProfileError(f"{path}: {e}") from e


def merge(profile: WorkerProfile, overrides: dict[str, Any]) -> WorkerProfile:
    """The profile with every override that is not None (or empty) applied."""
    given = {k: v for k, v in overrides.items() if v is not None and v != () and v != []}
    if "queues" in given:
        given["queues"] = list(given["queues"])
    if "model" in given:  # `--model` (given several times: a tuple) replaces both keys
        named = [given["model"]] if isinstance(given["model"], str) else list(given["model"])
        given["model"], given["models"] = named[0], named if len(named) > 1 else []
    try:
        merged = msgspec.structs.replace(profile, **given)
    except TypeError as e:
        raise ProfileError(f"unknown worker setting: {e}") from e
    except ValueError as e:  # __post_init__'s checks (several models with an adapter...)
        raise ProfileError(f"worker setting {e}") from e
    try:  # flags are held to the same limits as profile files
        return msgspec.convert(msgspec.to_builtins(merged), WorkerProfile)
    except msgspec.ValidationError as e:
        raise ProfileError(f"worker setting {e}") from e
