"""The function name mlxq jobs carry in RQ.

An mlxq worker never imports or calls job functions: it checks that a job names
``mlxq.jobs.generate`` and hands its request to the engine. This function exists so
that the name resolves, and so that a plain ``rq worker`` that picks an mlxq job up
fails with a clear message instead of doing something surprising.
"""

from __future__ import annotations

from typing import Any


def generate(request: dict[str, Any]) -> None:
    """Placeholder target of mlxq jobs; only ``mlxq worker`` runs them."""
    raise RuntimeError(
        "mlxq jobs run on `mlxq worker --model ...`, not on `rq worker`: "
        "start an mlxq worker on this queue"
    )
