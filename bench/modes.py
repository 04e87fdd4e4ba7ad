"""How each mode of ``throughput.py`` runs a workload, and the figures it returns.

``naive`` (one request at a time, extrapolated), ``batch_generate`` (mlx-lm's function),
``raw`` (mlx-lm's ``BatchGenerator`` at mlxq's sizes), ``mlxq`` / ``mlxq-bg`` (submit,
a burst worker, results read back: the whole product path) and ``mlxq-direct`` (mlxq's
engine on its Runner, the jobs handed over in-process: no Redis, no worker thread).
``throughput.py`` picks the modes, the model and the workloads, and reports.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass, field
from typing import Any

from common import (
    BENCH_RESULT_TTL,
    Stopwatch,
    bench_queue,
    drain,
    drop_batch,
    rate,
    work_burst,
)
from workloads import Workload


# -- results -----------------------------------------------------------------------------
@dataclass
class ModeResult:
    """One mode's figures on one workload."""

    mode: str
    wall_s: float
    gen_tokens: int  # generated tokens counted (naive: of the timed requests only)
    prompt_tokens: int
    prompt_tps: float | None
    peak_gb: float | None = None
    timed_requests: int | None = None  # naive: requests actually run, when extrapolated
    expected_gen_tokens: int = 0
    errors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def extrapolated(self) -> bool:
        return self.timed_requests is not None

    @property
    def gen_tps(self) -> float | None:
        total = self.expected_gen_tokens if self.extrapolated else self.gen_tokens
        return rate(total, self.wall_s)


def peak_gb() -> float | None:
    import mlx.core as mx

    try:
        return mx.get_peak_memory() / 1e9
    except Exception:  # not every backend reports it
        return None


def fresh_memory() -> None:
    """Release what the previous mode left: cached buffers and the peak-memory mark."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


# -- modes -------------------------------------------------------------------------------
def run_naive(model: Any, tokenizer: Any, wl: Workload, limit: int) -> ModeResult:
    """One request at a time; with ``limit`` only the first requests, then extrapolate.

    The estimate for all requests is prompt tokens at the measured prefill rate plus
    generated tokens at the measured decode rate (both from the timed requests).
    """
    from mlx_lm import stream_generate

    n = len(wl.prompts)
    k = n if limit <= 0 else min(limit, n)
    prefill_s = decode_s = 0.0
    gen = prompt = 0
    clock = Stopwatch()
    for tokens, max_tokens in zip(wl.prompts[:k], wl.max_tokens[:k], strict=True):
        t0 = time.perf_counter()
        last = None
        for response in stream_generate(model, tokenizer, tokens, max_tokens=max_tokens):
            last = response
        assert last is not None
        seconds = time.perf_counter() - t0
        p_s = last.prompt_tokens / last.prompt_tps  # prefill + first token
        prefill_s, decode_s = prefill_s + p_s, decode_s + seconds - p_s
        gen, prompt = gen + last.generation_tokens, prompt + last.prompt_tokens
    wall = clock.stop()
    result = ModeResult("naive", wall, gen, prompt, rate(prompt, prefill_s), peak_gb())
    result.expected_gen_tokens = wl.gen_tokens
    if k < n:
        result.timed_requests = k
        result.extra = {"timed_wall_s": wall, "timed_gen_tokens": gen}
        per_prompt = prefill_s / prompt if prompt else 0.0
        per_gen = decode_s / gen if gen else 0.0
        result.wall_s = wl.prompt_tokens * per_prompt + wl.gen_tokens * per_gen
        result.prompt_tokens = wl.prompt_tokens
    return result


def run_batch_generate(model: Any, tokenizer: Any, wl: Workload) -> ModeResult:
    """``mlx_lm.batch_generate`` with its default batch sizes."""
    from mlx_lm import batch_generate

    clock = Stopwatch()
    out = batch_generate(
        model, tokenizer, wl.prompts, max_tokens=list(wl.max_tokens), return_token_ids=True
    )
    wall = clock.stop()
    gen = sum(len(t) for t in out.token_ids or [])
    result = ModeResult("batch_generate", wall, gen, wl.prompt_tokens, out.stats.prompt_tps)
    result.peak_gb, result.expected_gen_tokens = peak_gb(), wl.gen_tokens
    return result


def run_raw(model: Any, wl: Workload, batch: int, prefill_batch: int, prefill_step: int):
    """``BatchGenerator`` at mlxq's sizes: all requests inserted up front, drained."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import greedy_sampler

    gen = BatchGenerator(
        model,
        stop_tokens=None,
        sampler=greedy_sampler,
        completion_batch_size=batch,
        prefill_batch_size=prefill_batch,
        prefill_step_size=prefill_step,
    )
    n, finished, tokens = len(wl.prompts), 0, 0
    try:
        clock = Stopwatch()
        with gen.stats() as stats:
            gen.insert(wl.prompts, list(wl.max_tokens))
            while finished < n:
                prompt_responses, responses = gen.next()
                if not prompt_responses and not responses:
                    break  # nothing left to do (should not happen)
                tokens += len(responses)
                finished += sum(r.finish_reason is not None for r in responses)
        wall = clock.stop()
    finally:
        gen.close()
    result = ModeResult("raw", wall, tokens, wl.prompt_tokens, stats.prompt_tps, peak_gb())
    result.expected_gen_tokens = wl.gen_tokens
    result.errors = n - finished
    return result


# The engine's counts each mlxq row reports (EngineStats fields).
WORK_STATS = (
    "prefilled_tokens",
    "prefill_calls",
    "decode_seconds",
    "decode_steps",
    "launch_seconds",
    "cache_copies",
    "cache_copy_seconds",
    "forward_traces",
)
PREFIX_STATS = ("prefix_hits", "reused_tokens", "stored_tokens", "prefix_evictions")


def run_mlxq(
    model: Any,
    tokenizer: Any,
    name: str,
    wl: Workload,
    profile: Any,
    url: str,
    prefix_cache_bytes: int = 0,
    engine: str = "slot",
):
    """Submit, run a burst worker on the main thread, read every result back.

    ``engine``: "slot" (mlxq's default engine) or "batch_generator" (mode ``mlxq-bg``).

    The prompt tok/s is effective: the requests' prompt tokens over the engine's prefill
    time (``Engine.stats()``), so prompt tokens taken from the prefix cache count too.
    """
    from mlxq.broker.batches import connect, iter_batch_results, submit
    from mlxq.wire import Request
    from mlxq.worker.rq_worker import MlxqWorker

    readings: dict[str, Any] = {}
    runner = _runner(model, tokenizer, name, profile, prefix_cache_bytes, engine, readings)
    conn = connect(url)
    queue = bench_queue()
    requests = [
        Request(prompt=p, max_tokens=m) for p, m in zip(wl.prompts, wl.max_tokens, strict=True)
    ]
    worker = MlxqWorker([queue], connection=conn, runner=runner, model_name=name)
    try:
        clock = Stopwatch()
        batch = submit(conn, requests, queue=queue, result_ttl=BENCH_RESULT_TTL)
        submit_s = clock.stop()
        idle_before = runner.idle_seconds
        work_s, exit_s = work_burst(worker)
        idle_s = runner.idle_seconds - idle_before
        clock = Stopwatch()
        results = list(iter_batch_results(conn, batch.batch_id))
        read_s = clock.stop()
        drop_batch(conn, batch.batch_id, queue)
    finally:
        runner.stop()
        conn.close()
    wall = submit_s + work_s + read_s
    done = [r for r in results if r is not None and r.finish_reason in ("length", "stop")]
    gen = sum(r.usage.completion_tokens for r in done)
    done_work = runner.engine.stats().since(readings["start"])
    prefill_s = done_work.prefill_seconds
    mode = ("mlxq" if engine == "slot" else "mlxq-bg") + ("+prefix" if prefix_cache_bytes else "")
    result = ModeResult(mode, wall, gen, wl.prompt_tokens, rate(wl.prompt_tokens, prefill_s))
    result.peak_gb = peak_gb()
    result.expected_gen_tokens, result.errors = wl.gen_tokens, len(results) - len(done)
    result.extra = {"submit_s": submit_s, "worker_s": work_s, "read_s": read_s}
    result.extra["worker_exit_s"] = exit_s
    result.extra["prefill_s"] = prefill_s
    result.extra["idle_s"] = idle_s
    keep = WORK_STATS
    if prefix_cache_bytes:
        result.extra["prefix_cache_bytes"] = prefix_cache_bytes
        keep += PREFIX_STATS
    result.extra.update({k: getattr(done_work, k) for k in keep})
    return result


def _runner(
    model: Any,
    tokenizer: Any,
    name: str,
    profile: Any,
    prefix_cache_bytes: int,
    kind: str,
    readings: dict[str, Any],
) -> Any:
    """A started Runner over the loaded model, its engine and scheduler as a worker of
    ``profile`` makes them (``readings["start"]``: the engine's stats before any job)."""
    from mlxq.engine.models.facts import model_info
    from mlxq.engine.protocol import BatchEngine
    from mlxq.engine.runner import Runner
    from mlxq.worker.config import resolve
    from mlxq.worker.launch import build_scheduler, engine_for

    configs: list[Any] = []

    def make_engine(facts: Any) -> BatchEngine:  # as mlxq.worker.launch.Setup, loaded model
        info = model_info(model, name, vocab_size=len(tokenizer))
        config = dataclasses.replace(
            resolve(profile, facts, info), prefix_cache_bytes=prefix_cache_bytes
        )
        configs.append(config)
        engine = engine_for(model, tokenizer, config, engine=kind)
        readings["start"] = engine.stats()
        return engine

    runner = Runner(make_engine, lambda engine, facts: build_scheduler(configs[0]))
    runner.start()
    return runner


def run_mlxq_direct(model: Any, tokenizer: Any, name: str, wl: Workload, profile: Any):
    """mlxq's slot engine on its Runner, every job handed over in-process at once: no
    Redis and no worker thread beside the MLX thread (what the queue costs is mode
    ``mlxq`` against this one)."""
    from mlxq.engine.runner import Work
    from mlxq.engine.sampling import EngineJob
    from mlxq.wire import Request

    readings: dict[str, Any] = {}
    runner = _runner(model, tokenizer, name, profile, 0, "slot", readings)
    works = [
        Work(EngineJob(f"r{i}", Request(prompt=p, max_tokens=m)), list(p))
        for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens, strict=True))
    ]
    try:
        idle_before, clock = runner.idle_seconds, Stopwatch()
        runner.submit(works)
        done = drain(runner, len(works))
        wall = clock.stop()
        idle_s = runner.idle_seconds - idle_before
    finally:
        runner.stop()
    ended = [c for c in done if c.finish_reason in ("length", "stop")]
    work = runner.engine.stats().since(readings["start"])
    gen = sum(len(c.token_ids) for c in ended)
    result = ModeResult(
        "mlxq-direct", wall, gen, wl.prompt_tokens, rate(wl.prompt_tokens, work.prefill_seconds)
    )
    result.peak_gb = peak_gb()
    result.expected_gen_tokens, result.errors = wl.gen_tokens, len(done) - len(ended)
    result.extra = {"worker_s": wall, "prefill_s": work.prefill_seconds, "idle_s": idle_s}
    result.extra.update({k: getattr(work, k) for k in WORK_STATS})
    return result


def median_run(runs: list[ModeResult]) -> ModeResult:
    """The run with the median wall time (the slower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    chosen = ordered[len(ordered) // 2]
    if len(runs) > 1:
        chosen.extra["repeat_wall_s"] = [round(r.wall_s, 4) for r in runs]
    return chosen
