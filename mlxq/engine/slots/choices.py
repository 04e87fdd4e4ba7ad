"""What the slot engine's decode steps run with: chosen once at start from the backend
(each choice measured, bench/RESULTS.md), logged, and overridable from the environment.

- attention: :func:`~mlxq.engine.slots.attention.choose_kernel` (``MLXQ_DECODE_ATTENTION``), or
  the quantized kernel for a quantized cache (``kv_bits``);
- overlap (``MLXQ_SLOT_OVERLAP``): build the next step while the last one runs, although
  its cache writes then copy: 1.07-1.08x on CUDA; on the CPU the copies cost 20x a step;
- group splits (``MLXQ_SPLIT_BYTES``): the bytes of one layer's keys and values a group
  of rows must save to attend apart from its neighbour (a group costs kernel launches and
  host work); 0 splits always;
- the compiled forward (``MLXQ_SLOT_COMPILE``): on CUDA only. A CUDA decode step is
  host-bound, and the compiled one costs the host less: 1.16-1.20x the gen tok/s on the
  H200 (1B, batch 256; uniform, varied outputs, JSON-schema and free jobs, alternating
  processes on one host; 1.36x on 8B's varied outputs), after a first-use kernel build
  of about 20 s on a fresh machine. The CPU pays for its whole-capacity span; Metal is unmeasured;
- sorting rows by length (``MLXQ_SLOT_SORT=0`` turns it off; never with the compiled
  forward, which attends the whole capacity anyway: ``MLXQ_SLOT_SORT=1`` with it is refused);
- join wait (``MLXQ_JOIN_WAIT``): decode steps the oldest waiting job may wait before a
  smaller group than ``join_group`` joins, while fewer jobs wait than slots are free: 4.
  On the H200 (1B, batch 256, varied and mixed outputs) 4 ran 1.19x and 1.09x faster
  than 16, and 16 faster than 32 (the queue was running dry: free slots idled longer);
- join cost (``MLXQ_JOIN_COST``): a prefill call's fixed cost in decode steps, which the
  free slots may idle (times the batch, in slot-steps) before a group joins while every
  free slot has a job waiting (:class:`~mlxq.engine.slots.joins.JoinPolicy`): 1 on GPUs,
  where a small call reads every weight as a step does; 0 (at once) on the CPU, where
  holding joins back measured no faster (0.98-1.00x, bench/RESULTS.md);
- fused projections (``MLXQ_FUSE_PROJECTIONS=1|attention|0``, CUDA only by default): q, k
  and v (and gate and up) as one matmul each
  (:mod:`~mlxq.engine.models.fused_projections`), because a CUDA step's host time is mostly
  matmul launches;
- prefill buckets (``MLXQ_PREFILL_BUCKETS``, CUDA only by default): a prefill call's rows
  and length are rounded to a few sizes (:mod:`~mlxq.engine.slots.buckets`), because each
  new shape first builds its kernels there;
- prefill streams (``MLXQ_PREFILL_STREAMS``, CPU only): the CPU streams a prefill call's
  prompts split over, 2 by default where there are 2 cores or more
  (:mod:`~mlxq.engine.slots.prefill_streams`);
- decode streams (``MLXQ_DECODE_STREAMS``, CPU only): the CPU streams a decode step's
  attention groups share out among (:func:`~mlxq.engine.slots.order.share_out`), 2 by
  default where there are 2 cores or more, because the softmax runs on one thread a stream;
- prefill blocks (``MLXQ_PREFILL_BLOCK``, CPU only by default): a prefill call (each
  part of one split over streams) attends in blocks of 32 query rows, each over the keys
  up to its own (:mod:`~mlxq.engine.slots.causal_blocks`), because MLX's CPU attention
  computes and exponentiates the whole square;
- softmax (``MLXQ_SOFTMAX``): ``pow2`` on the CPU, where MLX's ``exp`` is slow, for the
  attention mlxq composes (:mod:`~mlxq.engine.slots.softmax`);
- SiLU (``MLXQ_SILU``): ``pow2`` on the CPU, for the MLP's ``swiglu``
  (:mod:`~mlxq.engine.slots.silu`), for the same reason.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from mlxq.engine.models import fused_projections
from mlxq.engine.settings import number, whole_number
from mlxq.engine.slots.attention import Kernel, choose_kernel, quantized_kernel
from mlxq.engine.slots.causal_blocks import BLOCK_ENV, choose_block
from mlxq.engine.slots.prefill_streams import choose_streams
from mlxq.engine.slots.silu import choose_silu
from mlxq.engine.slots.softmax import SOFTMAX_ENV, SOFTMAXES, choose_softmax
from mlxq.wire import ModelInfo

OVERLAP_ENV = "MLXQ_SLOT_OVERLAP"
SPLIT_ENV = "MLXQ_SPLIT_BYTES"
COMPILE_ENV = "MLXQ_SLOT_COMPILE"
SORT_ENV = "MLXQ_SLOT_SORT"
DECODE_STREAMS_ENV = "MLXQ_DECODE_STREAMS"
# A guess per backend, from launch costs and memory bandwidth (CUDA measured: merging the
# groups of a 1B model ran 1.05x).
SPLIT_BYTES = {"cuda": 64 << 20, "metal": 8 << 20, "cpu": 1 << 20}
JOIN_ENV = "MLXQ_JOIN_WAIT"
JOIN_WAIT = 4
JOIN_COST_ENV = "MLXQ_JOIN_COST"
JOIN_COST = {"cuda": 1.0, "metal": 1.0, "cpu": 0.0}
BUCKETS_ENV = "MLXQ_PREFILL_BUCKETS"


@dataclass(frozen=True)
class DecodeChoices:
    """The decode settings of one engine (module docstring)."""

    attention: str
    kernel: Kernel
    kv_bits: int | None  # a quantized cache's bits, None for the model's dtype
    kv_group: int  # quantization group of a quantized cache
    overlap: bool
    saving: int  # row-positions a group split must save
    compiled: bool
    sorting: bool
    join_wait: int  # decode steps before a small group joins
    join_cost: float  # a prefill call's fixed cost, in decode steps
    prefill_buckets: bool  # prefill calls padded to a few shapes
    prefill_streams: int  # CPU streams a prefill call splits over (1: not split)
    decode_streams: int  # CPU streams a step's attention groups share out among
    prefill_block: int  # query rows a block of a prefill's causal attention (0: one call)
    softmax: str  # the softmax of the attention mlxq composes: "pow2" or "mlx"
    silu: str  # the MLP's swiglu: "pow2" or "mlx"
    fused: tuple[str, ...]  # sibling projections run as one matmul: "attention", "mlp"

    @classmethod
    def choose(
        cls, backend: str, info: ModelInfo, attention: str | None, kv_bits: int | None
    ) -> DecodeChoices:
        """The choices for ``info``'s model on ``backend``; raises ``ValueError`` for an
        unknown attention, a cache that cannot be quantized as asked, sorting asked of the
        compiled forward, or a softmax asked where nothing composes one."""
        name, kernel = choose_kernel(backend, attention, info.head_dim)
        group = 64
        if kv_bits is not None:
            group, kernel = quantized_kernel(kv_bits, info.head_dim)
            name = f"{kv_bits}-bit quantized"
        block = choose_block(backend)
        softmax, kernel = _with_softmax(backend, name, kernel, kv_bits is not None, block)
        env = os.environ.get
        compiled = env(COMPILE_ENV, "1" if backend == "cuda" else "0") == "1"
        if compiled and env(SORT_ENV) == "1":  # (asked for, not the default: refused)
            raise ValueError(
                f"{SORT_ENV}=1 needs the eager decode forward ({COMPILE_ENV}=0): the "
                "compiled one attends every row over the whole capacity and never sorts"
            )
        limit = whole_number(SPLIT_ENV, SPLIT_BYTES.get(backend, 1 << 20), 0, " of bytes")
        return cls(
            attention=name,
            kernel=kernel,
            kv_bits=kv_bits,
            kv_group=group,
            overlap=env(OVERLAP_ENV, "1" if backend == "cuda" else "0") == "1",
            saving=limit // max(1, info.kv_bytes_per_token // max(1, info.num_layers)),
            compiled=compiled,
            sorting=not compiled and env(SORT_ENV, "1") == "1",
            join_wait=whole_number(JOIN_ENV, JOIN_WAIT, 0, " of decode steps"),
            join_cost=number(JOIN_COST_ENV, JOIN_COST.get(backend, 0.0), 0, " of decode steps"),
            prefill_buckets=env(BUCKETS_ENV, "1" if backend == "cuda" else "0") == "1",
            prefill_streams=choose_streams(backend),
            decode_streams=choose_streams(backend, DECODE_STREAMS_ENV),
            prefill_block=block,
            softmax=softmax,
            silu=choose_silu(backend),
            fused=fused_projections.wanted(backend),
        )

    def describe(self) -> str:
        """One log line's worth."""
        return (
            f"{self.attention} decode attention{' (compiled forward)' if self.compiled else ''}"
            f", steps overlapped: {self.overlap}, rows sorted by length: {self.sorting}"
            f", small groups join after {self.join_wait} steps (or when their free slots "
            f"idled {self.join_cost:g} steps' worth)"
            f", prefill shapes bucketed: {self.prefill_buckets}"
            f", prefill split over {self.prefill_streams} CPU stream(s)"
            f", decode attention over {self.decode_streams} CPU stream(s)"
            f", prefill attention in blocks of {self.prefill_block or 'all'} query rows"
            f", softmax {self.softmax}, SiLU {self.silu}"
            f", projections fused: {', '.join(self.fused) or 'none'}"
        )


def _with_softmax(
    backend: str, name: str, kernel: Kernel, quantized: bool, block: int
) -> tuple[str, Kernel]:
    """The softmax's name, and ``kernel`` with it where the kernel composes a softmax;
    raises ``ValueError`` where ``MLXQ_SOFTMAX`` asks for one that nothing would use."""
    softmax = choose_softmax(backend)
    composes = name == "gqa" or quantized
    if composes:
        kernel = functools.partial(kernel, softmax=SOFTMAXES[softmax])
    # (A default that goes unused is not refused: MLX's softmax runs inside its kernels.)
    if os.environ.get(SOFTMAX_ENV) is not None and softmax != "mlx" and not (composes or block):
        raise ValueError(
            f"{SOFTMAX_ENV}={softmax} applies where mlxq composes the attention: the gqa "
            f"decode attention, a quantized cache or prefill blocks ({BLOCK_ENV}); this "
            f"engine has {name} decode attention and no prefill blocks"
        )
    return softmax, kernel
