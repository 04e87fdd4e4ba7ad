"""Joining the group of ranks, and checking that they can work together.

MLX's ring backend reads its rank from ``MLX_RANK`` and every rank's address from the JSON
file ``MLX_HOSTFILE`` (``[["ip:port"], ...]``, one list per rank); ``mx.distributed.init``
then waits for the neighbours, with no deadline of its own: :func:`join` gives it one.
Then every rank says who it is (:class:`Hello`) and every rank checks the same list
(:func:`mismatch`): the same mlxq, MLX and mlx-lm, the same model files. The smallest
rank's memory sizes the batch; rank 0's seed seeds every rank's random state.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import msgspec

from mlxq.engine.distributed.channel import Channel
from mlxq.engine.distributed.silence import Silence
from mlxq.engine.hardware import device_facts
from mlxq.engine.settings import number
from mlxq.errors import StartupError, one_line

# How long a rank waits for the others to start and connect (MLXQ_JOIN_TIMEOUT overrides).
JOIN_TIMEOUT_S = 120.0
JOIN_TIMEOUT_ENV = "MLXQ_JOIN_TIMEOUT"
BACKENDS = ("ring", "jaccl")


class Hello(msgspec.Struct):
    """What a rank tells the others at start."""

    rank: int
    host: str
    versions: str  # mlxq, mlx and mlx-lm
    model: str
    digest: str  # of the model's files (model_digest)
    memory_bytes: int
    seed: int


class Start(msgspec.Struct):
    """A rank that joined its group and checked its peers."""

    rank: int
    size: int
    hosts: list[str]  # by rank
    memory_bytes: int  # the smallest rank's
    seed: int  # rank 0's


def versions() -> str:
    """The versions every rank must share."""
    return " ".join(f"{p} {version(p)}" for p in ("mlxq", "mlx", "mlx-lm"))


def model_digest(path: Path) -> str:
    """A digest of a model folder: its small files' bytes and its large files' names and
    sizes (weights are not read whole: a 70B model's would take minutes)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}\n".encode())
        if size < 1 << 20:
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def peers() -> str:
    """The other ranks' addresses, from MLX's environment (for error lines)."""
    rank = os.environ.get("MLX_RANK", "?")
    try:
        hosts = json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())
    except (KeyError, OSError, ValueError):
        return "the other ranks"
    return ", ".join(f"rank {r} at {','.join(h)}" for r, h in enumerate(hosts) if str(r) != rank)


def join(backend: str, timeout: float | None = None) -> mx.distributed.Group:
    """``mx.distributed.init`` of ``backend``. If the other ranks do not connect within
    ``timeout`` seconds, a watcher process (:class:`Silence`) prints one line naming them
    and ends this one (MLX's init holds the GIL while it waits: no thread of this process
    could)."""
    if timeout is None:
        timeout = number(JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S, 0, " of seconds")
    rank = os.environ.get("MLX_RANK", "?")
    line = (
        f"mlxq: error: rank {rank}: {peers()} did not connect within {timeout:g}s: start "
        "every rank (or check the hosts, their firewall and MLX_HOSTFILE)"
    )
    watch = Silence(timeout, line)  # (never ticked: the whole init is one wait)
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except Exception as e:
        raise StartupError(
            f"rank {rank}: cannot join the {backend} group ({one_line(e)}): set MLX_RANK "
            "and MLX_HOSTFILE, or start the ranks with `mlxq worker --hosts`"
        ) from e
    finally:
        watch.close()


def greet(channel: Channel, model: str, path: Path) -> Start:
    """Exchange :class:`Hello` with every rank; a :class:`StartupError` (on every rank)
    naming the first host that differs from rank 0."""
    me = Hello(
        rank=channel.rank,
        host=socket.gethostname(),
        versions=versions(),
        model=model,
        digest=model_digest(path),
        memory_bytes=device_facts().memory_bytes,
        seed=random.getrandbits(31),
    )
    hellos = [msgspec.json.decode(b, type=Hello) for b in channel.gather(msgspec.json.encode(me))]
    why = mismatch(hellos)
    if why is not None:
        raise StartupError(why)
    mx.random.seed(hellos[0].seed)
    return Start(
        rank=channel.rank,
        size=channel.size,
        hosts=[h.host for h in hellos],
        memory_bytes=min(h.memory_bytes for h in hellos),
        seed=hellos[0].seed,
    )


def mismatch(hellos: list[Hello]) -> str | None:
    """Why these ranks cannot run one model together (naming the host), or None."""
    first = hellos[0]
    for h in hellos[1:]:
        where = f"rank {h.rank} on host {h.host}"
        if h.versions != first.versions:
            return (
                f"{where} runs {h.versions}, rank 0 on {first.host} runs {first.versions}: "
                "install the same versions on every host"
            )
        if h.digest != first.digest:
            return (
                f"{where} has other files for model {h.model} (digest {h.digest}) than rank "
                f"0 on {first.host} ({first.model}, {first.digest}): copy the same model there"
            )
    return None
