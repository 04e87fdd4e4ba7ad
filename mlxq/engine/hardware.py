"""What machine the worker runs on: device, memory, and how much of it KV caches may use.

Called once on the MLX thread at start-up.
"""

from __future__ import annotations

import os
import platform

import msgspec


class DeviceFacts(msgspec.Struct):
    """The accelerator (or CPU) MLX runs on and its memory."""

    backend: str  # "metal", "cuda" or "cpu"
    name: str
    memory_bytes: int
    recommended_bytes: int  # what MLX suggests keeping the working set under
    host: str
    os: str
    # What memory the worker's caches live in, as workers on one host compare it: "system"
    # (unified memory on a Mac, RAM on the CPU) or "cuda:N" (one GPU's own memory).
    memory_domain: str = "system"


def system_memory() -> int:
    """Physical memory of this machine in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def backend_name() -> str:
    """The backend MLX computes on: "metal", "cuda" or "cpu"."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def device_facts() -> DeviceFacts:
    """Read the device MLX uses and its memory."""
    import mlx.core as mx

    info = dict(mx.device_info()) if hasattr(mx, "device_info") else {}
    backend = backend_name()
    memory = int(info.get("memory_size") or info.get("total_memory") or system_memory())
    recommended = int(info.get("max_recommended_working_set_size") or memory)
    return DeviceFacts(
        backend=backend,
        name=str(info.get("device_name") or info.get("architecture") or platform.processor()),
        memory_bytes=memory,
        recommended_bytes=min(recommended, memory),
        host=platform.node(),
        os=f"{platform.system()} {platform.release()}",
        memory_domain=memory_domain(backend),
    )


def memory_domain(backend: str) -> str:
    """Which memory this process allocates from: a CUDA worker only shares its GPU (the
    first of ``CUDA_VISIBLE_DEVICES``, as MLX uses it) with workers pinned to the same one."""
    if backend != "cuda":
        return "system"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return f"cuda:{visible or '0'}"
