"""How a worker over several ranks splits its model: by heads or by layers, and why.

Tensor parallel (:mod:`~mlxq.engine.distributed.tensor`) shares every layer's work and
costs two ``all_sum`` a layer per step: over MLX's ring (TCP: Ethernet, or Thunderbolt
as IP) their latency and bytes dominate a step (``bench/distributed.py``: two ranks ran
at 0.39x one rank's tokens/s on one machine). Pipeline parallel
(:mod:`~mlxq.engine.distributed.stages`, :mod:`~mlxq.engine.distributed.pipeline`)
sends one array a step between neighbours and keeps every rank busy with micro-batches
in flight. So ``auto`` picks pipeline over ring and tensor over jaccl (RDMA: collectives
in microseconds), each where the model allows it, else the other. Every rank makes the
same choice from the same settings and model files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxq.engine.distributed.stages import stage, unpipelinable
from mlxq.engine.distributed.tensor import shard, unshardable
from mlxq.engine.models.source import load_model
from mlxq.errors import StartupError

_WHY_AUTO = {
    "pipeline": "auto over ring: one send a step between stages, where tensor parallel's two "
    "all_sums a layer would dominate a step",
    "tensor": "auto over jaccl: RDMA makes tensor parallel's all_sums cheap",
}


def choose_split(parallel: str, backend: str, model: Any, size: int) -> tuple[str, str]:
    """The split (``tensor`` or ``pipeline``) and why; a :class:`StartupError` in one
    line if the model allows neither the one asked for nor (``auto``) any."""
    why_not = {"tensor": unshardable(model, size), "pipeline": unpipelinable(model, size)}
    if parallel != "auto":
        if why_not[parallel] is not None:
            raise StartupError(
                f"the model cannot be split over {size} ranks by --parallel {parallel}: "
                f"{why_not[parallel]}; try the other --parallel, or fewer hosts"
            )
        return parallel, f"--parallel {parallel}"
    prefer = "tensor" if backend == "jaccl" else "pipeline"
    other = "pipeline" if prefer == "tensor" else "tensor"
    if why_not[prefer] is None:
        return prefer, _WHY_AUTO[prefer]
    if why_not[other] is None:
        return other, f"auto: {prefer} parallel cannot run it ({why_not[prefer]})"
    raise StartupError(
        f"the model cannot be split over {size} ranks: not by heads ({why_not['tensor']}), "
        f"not by layers ({why_not['pipeline']}); use fewer hosts or another model"
    )


def load_split(
    name: str,
    path: Path,
    adapter_path: str | None,
    group: mx.distributed.Group,
    parallel: str = "auto",
    backend: str = "ring",
) -> tuple[Any, Any, str, str]:
    """This rank's part of the model, loaded (weights load lazily: only that part is
    read), the tokenizer, the split and why."""
    if adapter_path is not None:
        raise StartupError(
            "a LoRA adapter cannot be split over ranks yet: fuse it into the model "
            "(`mlx_lm.fuse`) and serve the fused model"
        )
    model, tokenizer = load_model(name, path, lazy=True)
    try:
        split, why = choose_split(parallel, backend, model, group.size())
    except StartupError as e:
        raise StartupError(f"model {name}: {e}") from e
    if split == "tensor":
        shard(model, group)
    else:
        stage(model, group)
    return model, tokenizer, split, why
