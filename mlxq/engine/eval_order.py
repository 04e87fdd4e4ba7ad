"""MLX's evaluation order on the CPU: wide enough that two streams' work runs side by side.

Assumptions, MLX 0.32 (``eval_impl`` in ``mlx/transforms.cpp``; the pin is in
pyproject.toml):

- An evaluation lays its graph out breadth first from the outputs, but only while fewer
  than ``MLX_BFS_MAX_WIDTH`` arrays (default 20) wait in the queue; past that it goes
  depth first, so one output's whole graph comes before the next one's.
- It then dispatches the arrays in that order with at most about 100 operations in flight
  (``MAX_ACTIVE_TASKS`` tasks of ``DISPATCHES_PER_TASK`` operations), waiting for one to
  finish before dispatching more.
- The width is read once, at the process's first evaluation, from the environment.

A prefill split over two CPU streams (:mod:`~mlxq.engine.slots.prefill_streams`) whose
parts attend in blocks (:mod:`~mlxq.engine.slots.causal_blocks`) holds far more than 20
arrays a level. Depth first, the first part's graph is dispatched and run nearly whole
before the second part's starts: the two streams take turns, each on one core. Laid out
level by level, both parts' operations are in flight at once. Measured, two 1,480-token
prompts on two streams in blocks of 128: 18.7-19.4 s at width 20, 10.2-11.1 s at 100,000
(bench/RESULTS.md; the worker's benchmarks ran at this module's 4,096).

The limit exists to bound the memory of graphs with thousands of independent branches;
the engine's widest level is a few hundred arrays (two parts of 16 blocks, each a handful
of arrays), so :data:`CPU_WIDTH` lays every graph of the engine out level by level. Other
backends keep MLX's default: one kernel at a time already fills a GPU.
"""

from __future__ import annotations

import os

from mlxq.engine.settings import whole_number

WIDTH_ENV = "MLX_BFS_MAX_WIDTH"
CPU_WIDTH = 4096


def widen(backend: str) -> None:
    """Lay MLX's evaluations out level by level in this process on the CPU (module
    docstring); a width the user set is kept. Call it before anything is evaluated: MLX
    reads the width once. Raises ``ValueError`` for a width that is not a positive whole
    number (MLX hangs on one)."""
    if os.environ.get(WIDTH_ENV) is None:
        if backend == "cpu":
            os.environ[WIDTH_ENV] = str(CPU_WIDTH)
        return
    whole_number(WIDTH_ENV, 0, 1, " of arrays")
