"""Helpers shared by the benchmark scripts: OpenBLAS, Redis, quiet logs, tables, JSON.

Imported as ``common`` by scripts run as ``python bench/NAME.py`` (their folder is then
the first entry of ``sys.path``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# The tokenizer-only install of transformers warns about PyTorch on import.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def set_up_like_mlxq() -> None:
    """Re-execute under OpenBLAS on Linux CPUs and set MLX's evaluation order, as the
    ``mlxq`` command does for model commands; call before anything evaluates."""
    from mlxq.engine.blas import reexec_with_openblas
    from mlxq.engine.eval_order import widen
    from mlxq.engine.hardware import backend_name

    reexec_with_openblas()
    widen(backend_name())


def quiet_logs() -> None:
    """Only warnings from RQ and mlxq: a per-job INFO line would cost time and flood output."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    for name in ("rq", "rq.worker", "rq.job", "mlxq"):
        logging.getLogger(name).setLevel(logging.WARNING)


@contextlib.contextmanager
def redis_url(url: str | None) -> Iterator[str]:
    """``url`` as given, or the URL of an embedded Valkey that lives for the block."""
    if url:
        yield url
        return
    from mlxq.server import embedded

    with embedded() as local:
        yield local


def bench_queue() -> str:
    """A queue name no worker of a shared Redis listens on."""
    return f"mlxq-bench-{uuid.uuid4().hex[:8]}"


def drop_batch(conn: Any, batch_id: str, queue: str) -> None:
    """Delete the queue (with any jobs still on it) and the batch records; results expire."""
    from mlxq.broker import keys
    from mlxq.broker.batches import make_queue

    make_queue(conn, queue).empty()
    conn.delete(keys.batch_info(batch_id), keys.batch_jobs(batch_id))
    conn.zrem(keys.batches(), batch_id)


# Jobs and results the benchmarks leave in a shared Redis expire after this long.
BENCH_RESULT_TTL = 600


def drain(runner: Any, count: int) -> list[Any]:
    """Completions from a Runner until ``count`` came; raises if its MLX thread stopped."""
    done: list[Any] = []
    while len(done) < count:
        done += runner.completions(timeout=1.0)
        if not runner.alive:
            raise RuntimeError("the MLX thread stopped (logged above)")
    return done


def work_burst(worker: Any) -> tuple[float, float]:
    """Run an RQ worker in burst mode on this (the main) thread.

    Returns the seconds until its loop ended (every job done) and the seconds of RQ's
    ``teardown`` after it, which are not throughput: RQ joins its pub/sub thread with a
    one-second timeout there. Restores the signal handlers the worker installs.
    """
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    teardown, marks = worker.teardown, {}

    def timed_teardown() -> None:
        marks["teardown"] = time.perf_counter()
        teardown()

    worker.teardown = timed_teardown
    start = time.perf_counter()
    try:
        worker.work(burst=True, logging_level="WARNING")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    end = time.perf_counter()
    loop_end = marks.get("teardown", end)
    return loop_end - start, end - loop_end


def median_seconds(
    build: Callable[[], Any], repeat: int, chain: int = 1, warmup: int = 1, quartile: bool = False
) -> float:
    """Median seconds of one ``build()``: its graph launched ``chain`` times per
    evaluation (so the device, not the host's launch, sets the time), after ``warmup``
    evaluations outside the timing. ``quartile``: the lower quartile instead (on a shared
    machine others' work only ever slows a run down)."""
    import mlx.core as mx

    for _ in range(warmup):
        mx.eval([build() for _ in range(chain)])
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        mx.eval([build() for _ in range(chain)])
        times.append((time.perf_counter() - tic) / chain)
    if quartile:
        return sorted(times)[len(times) // 4]
    return statistics.median(times)


def describe_device() -> str:
    """``backend name``, e.g. ``cuda NVIDIA H200`` or ``cpu AMD EPYC``."""
    from mlxq.engine.hardware import device_facts

    facts = device_facts()
    return f"{facts.backend} {facts.name}".strip()


class Stopwatch:
    """Wall seconds (``perf_counter``) between construction and ``stop``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds = 0.0

    def stop(self) -> float:
        self.seconds = time.perf_counter() - self.start
        return self.seconds


def rate(count: float, seconds: float | None) -> float | None:
    """``count / seconds``, or None when there is no time to divide by."""
    return count / seconds if seconds and seconds > 0 else None


def fmt_num(value: float | None, digits: int = 1) -> str:
    """A figure for a table: thousands separators, ``-`` when missing."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def fmt_ratio(value: float | None, base: float | None) -> str:
    """``value / base`` as ``1.23x``, or ``-``."""
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        rest = [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "   ".join([first, *rest]).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON (the only file a benchmark writes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    print(f"figures written to {path}")


def preset_tokenizer() -> Any:
    """The presets' tokenizer as mlx-lm's ``TokenizerWrapper``, built in memory."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    from mlxq.engine.models.make import BOS, CHAT_TEMPLATE, END, EOS_IDS, EOT, build_tokenizer

    hf = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), bos_token=BOS, eos_token=EOT, pad_token=END
    )
    hf.chat_template = CHAT_TEMPLATE
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=EOS_IDS)


def load_as_worker(model: str, dequantize: str = "auto") -> tuple[Any, Any, Any]:
    """``(model, tokenizer, device facts)``: a folder, hub id or ``.gguf`` file loaded as
    ``mlxq worker --model`` loads it (converted, weights in the format this backend picks,
    or as ``dequantize`` forces: ``--dequantize on|off``)."""
    from mlxq.engine.hardware import device_facts
    from mlxq.engine.models.source import load_model, resolve_model
    from mlxq.engine.models.weights import prepare_weights

    loaded, tokenizer = load_model(model, resolve_model(model))
    facts = device_facts()
    return prepare_weights(loaded, facts.backend, facts.memory_bytes, dequantize), tokenizer, facts


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """A process's peak resident set (``VmHWM`` of ``/proc/PID/status``), None where
    there is no such file (not Linux, the process gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Set a process's peak resident set back to its current one (Linux: ``5`` into
    ``/proc/PID/clear_refs``; this user's processes only); False where that fails."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def git_commit() -> str:
    """``git rev-parse --short HEAD`` of the checkout, or ``unknown``."""
    import subprocess

    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parent,
    )
    return done.stdout.strip() or "unknown"
