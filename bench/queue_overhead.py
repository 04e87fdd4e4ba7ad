"""What Redis and the RQ worker cost, without a model.

(a) submit: jobs/s that one process enqueues with ``mlxq.broker.batches.submit`` (pipelined, in
    chunks), and how long reading a batch's status and results back takes.
(b) worker: an ``MlxqWorker`` in burst mode on a Runner whose engine is a model-free stub
    that "generates" ``--gen-tokens`` tokens per job at a fixed ``--step-ms`` per decode
    step for up to ``--batch`` jobs at once. The same stub run without Redis (jobs handed
    to the Runner directly) is the baseline: the ratio of the two is what the queue,
    RQ's bookkeeping and the worker loop cost at that decode rate.

Usage: ``python bench/queue_overhead.py`` (see bench/README.md). Writes nothing unless
``--json PATH`` is given.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from common import (
    BENCH_RESULT_TTL,
    Stopwatch,
    bench_queue,
    drain,
    drop_batch,
    fmt_num,
    fmt_ratio,
    quiet_logs,
    rate,
    redis_url,
    table,
    work_burst,
    write_json,
)

from mlxq.engine.sampling import Completion, EngineJob
from mlxq.engine.stats import EngineStats
from mlxq.wire import ModelInfo, Request, StreamChunk

# The stub's one token id and the text it stands for (about four characters a token).
STUB_TOKEN, STUB_TEXT = 7, "tok "


class StubEngine:
    """A :class:`~mlxq.engine.protocol.BatchEngine` without a model: each step sleeps, then
    every job gets a token.

    ``busy_s`` is the time spent inside ``step`` (the "GPU" time); ``steps`` counts them.
    """

    def __init__(self, step_s: float) -> None:
        self.info = ModelInfo(
            name="stub",
            model_type="stub",
            num_layers=1,
            hidden_size=1,
            num_kv_heads=1,
            head_dim=1,
            vocab_size=32000,
            context_length=1 << 20,
            kv_bytes_per_token=1,
            param_bytes=0,
            dtype="float16",
        )
        self.step_s = step_s
        self.prefill_batch = 8
        self.busy_s = 0.0
        self.steps = self.generated = 0
        self._jobs: dict[str, dict[str, Any]] = {}

    @property
    def active(self) -> int:
        return len(self._jobs)

    def encode(self, request: Request) -> list[int]:
        if isinstance(request.prompt, list):
            return list(request.prompt)
        return [STUB_TOKEN] * max(1, len(request.prompt or "") // 4)

    def prefill_length(self, tokens: list[int]) -> int:
        return len(tokens)

    def set_prefill_batch(self, n: int) -> None:
        self.prefill_batch = max(1, n)

    def take_stream(self) -> list[StreamChunk]:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(generated_tokens=self.generated, decode_seconds=self.busy_s)

    def add(self, job: EngineJob, tokens: list[int] | None = None) -> Completion | None:
        if job.key in self._jobs:
            raise ValueError(f"job {job.key} is already in the engine")
        tokens = self.encode(job.request) if tokens is None else tokens
        self._jobs[job.key] = {"prompt": len(tokens), "n": 0, "admitted": time.time()}
        self._jobs[job.key]["max"] = job.request.max_tokens
        return None

    def step(self) -> list[Completion]:
        if not self._jobs:
            return []
        t0 = time.perf_counter()
        time.sleep(self.step_s)
        now, done = time.time(), []
        for key, j in list(self._jobs.items()):
            j["n"] += 1
            j.setdefault("first", now)
            if j["n"] >= j["max"]:
                del self._jobs[key]
                done.append(self._completion(key, j, "length", now))
        self.steps += 1
        self.generated += len(self._jobs) + len(done)
        self.busy_s += time.perf_counter() - t0
        return done

    @staticmethod
    def _completion(key: str, j: dict[str, Any], reason: Any, now: float) -> Completion:
        n = j["n"]
        return Completion(
            key=key,
            finish_reason=reason,
            text=STUB_TEXT * n,
            token_ids=[STUB_TOKEN] * n,
            prompt_tokens=j["prompt"],
            admitted_at=j["admitted"],
            first_token_at=j.get("first"),
            finished_at=now,
            prefill_seconds=j["first"] - j["admitted"] if "first" in j else None,
            decode_seconds=now - j["first"] if "first" in j else None,
        )

    def cancel(self, key: str) -> Completion | None:
        j = self._jobs.pop(key, None)
        return None if j is None else self._completion(key, j, "cancelled", time.time())

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        self._jobs.clear()


def _runner(engine: StubEngine, batch: int) -> Any:
    from mlxq.engine.runner import Runner
    from mlxq.engine.scheduler import Scheduler

    def make_scheduler(_engine: Any, _facts: Any) -> Scheduler:
        return Scheduler(
            max_batch=batch,
            kv_bytes_per_token=1,
            budget_bytes=1 << 40,
            context_length=1 << 20,
        )

    runner = Runner(lambda _facts: engine, make_scheduler)
    runner.start()
    return runner


def _commands(conn: Any) -> int | None:
    """Commands the server has run so far (INFO commandstats), or None if not readable."""
    try:
        stats = conn.info("commandstats")
    except Exception:
        return None
    return sum(int(v.get("calls", 0)) for v in stats.values() if isinstance(v, dict))


# -- (a) submit ----------------------------------------------------------------------------
def bench_submit(conn: Any, n: int) -> dict[str, Any]:
    from mlxq.broker.batches import batch_status, iter_batch_results, submit

    requests = [Request(prompt="Say hi.", max_tokens=16) for _ in range(n)]
    queue = bench_queue()
    before = _commands(conn)
    clock = Stopwatch()
    batch = submit(conn, requests, queue=queue, result_ttl=BENCH_RESULT_TTL)
    submit_s = clock.stop()
    after = _commands(conn)
    clock = Stopwatch()
    status = batch_status(conn, batch.batch_id)
    status_s = clock.stop()
    clock = Stopwatch()
    results = list(iter_batch_results(conn, batch.batch_id))
    results_s = clock.stop()
    drop_batch(conn, batch.batch_id, queue)
    assert status.queued == n and len(results) == n, (status, len(results))
    commands = None if before is None or after is None else (after - before - 1) / n
    return {
        "jobs": n,
        "submit_s": submit_s,
        "submit_jobs_per_s": rate(n, submit_s),
        "commands_per_job": commands,
        "status_s": status_s,
        "results_s": results_s,
    }


# -- (b) worker ----------------------------------------------------------------------------
def run_direct(args: argparse.Namespace) -> dict[str, Any]:
    """The stub on a Runner, jobs handed over in-process: the no-Redis baseline."""
    from mlxq.engine.runner import Work

    engine = StubEngine(args.step_ms / 1000)
    runner = _runner(engine, args.batch)
    try:
        clock = Stopwatch()
        for i in range(args.jobs):
            request = Request(prompt=[STUB_TOKEN] * 8, max_tokens=args.gen_tokens)
            runner.submit([Work(EngineJob(f"j{i}", request), engine.encode(request))])
        done = len(drain(runner, args.jobs))
        wall = clock.stop()
    finally:
        runner.stop()
    return {"wall_s": wall, "busy_s": engine.busy_s, "steps": engine.steps, "jobs": done}


def run_worker(conn: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The stub behind Redis: submit, burst worker on this (main) thread, read back."""
    from mlxq.broker.batches import iter_batch_results, submit
    from mlxq.worker.rq_worker import MlxqWorker

    engine = StubEngine(args.step_ms / 1000)
    runner = _runner(engine, args.batch)
    queue = bench_queue()
    requests = [
        Request(prompt=[STUB_TOKEN] * 8, max_tokens=args.gen_tokens) for _ in range(args.jobs)
    ]
    worker = MlxqWorker([queue], connection=conn, runner=runner, model_name="stub")
    try:
        clock = Stopwatch()
        batch = submit(conn, requests, queue=queue, result_ttl=BENCH_RESULT_TTL)
        submit_s = clock.stop()
        before, cpu0 = _commands(conn), time.thread_time()
        work_s, exit_s = work_burst(worker)
        cpu, after = time.thread_time() - cpu0, _commands(conn)
        clock = Stopwatch()
        results = list(iter_batch_results(conn, batch.batch_id))
        read_s = clock.stop()
    finally:
        runner.stop()
    wall = submit_s + work_s + read_s
    done = sum(1 for r in results if r is not None and r.finish_reason == "length")
    drop_batch(conn, batch.batch_id, queue)
    commands = None if before is None or after is None else (after - before - 1) / args.jobs
    return {
        "wall_s": wall,
        "submit_s": submit_s,
        "worker_s": work_s,
        "read_s": read_s,
        "worker_exit_s": exit_s,
        "busy_s": engine.busy_s,
        "steps": engine.steps,
        "jobs": done,
        "worker_cpu_s": cpu,
        "commands_per_job": commands,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Redis and worker overhead of mlxq, with a model-free stub engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--submit-jobs", type=int, default=20000, help="(a): jobs to submit")
    ap.add_argument("--jobs", type=int, default=1000, help="(b): jobs the stub worker runs")
    ap.add_argument("--batch", type=int, default=64, help="(b): the stub's batch size")
    ap.add_argument("--gen-tokens", type=int, default=32, help="(b): tokens per job")
    ap.add_argument(
        "--step-ms",
        type=float,
        default=5.0,
        help="(b): the stub's time per decode step, whatever the batch size",
    )
    ap.add_argument("--skip", choices=["submit", "worker"], help="leave one part out")
    ap.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis instead of an embedded Valkey (private queues, removed afterwards)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the figures here")
    ap.add_argument(
        "--short",
        action="store_true",
        help="a seconds-long run of both parts (the test suite runs it so the script works)",
    )
    args = ap.parse_args(argv)
    if args.short:
        args.submit_jobs, args.jobs, args.batch, args.gen_tokens, args.step_ms = 200, 40, 8, 4, 1.0
    for name in ("submit_jobs", "jobs", "batch", "gen_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.step_ms < 0:
        ap.error("--step-ms must be at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logs()
    from mlxq.broker.batches import connect

    out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}}
    with redis_url(args.redis_url) as url:
        conn = connect(url)
        server = conn.info("server")
        kind = "valkey" if server.get("valkey_version") else "redis"
        version = server.get("valkey_version") or server.get("redis_version", "?")
        print(f"server: {kind} {version}{'' if args.redis_url else ' (embedded)'}")
        out["server"] = f"{kind} {version}"

        if args.skip != "submit":
            print(f"(a) submitting {args.submit_jobs:,} requests ...", file=sys.stderr)
            a = bench_submit(conn, args.submit_jobs)
            out["submit"] = a
            print()
            print(
                f"(a) submit: {a['jobs']:,} jobs in {a['submit_s']:.2f} s = "
                f"{fmt_num(a['submit_jobs_per_s'], 0)} jobs/s from one process "
                f"({fmt_num(a['commands_per_job'], 1)} Redis commands per job)"
            )
            print(
                f"    read back: batch_status {a['status_s']:.2f} s, iter_batch_results "
                f"{a['results_s']:.2f} s (for all {a['jobs']:,} jobs)"
            )

        if args.skip != "worker":
            print(f"(b) stub engine, {args.jobs:,} jobs: direct ...", file=sys.stderr)
            direct = run_direct(args)
            print("(b) ... through Redis and the worker ...", file=sys.stderr)
            worker = run_worker(conn, args)
            out["worker"] = {"direct": direct, "redis": worker}
            print()
            print(worker_report(args, direct, worker))
        conn.close()
    if args.json:
        write_json(args.json, out)
    return 0


def worker_report(args: argparse.Namespace, direct: dict, worker: dict) -> str:
    tokens = args.jobs * args.gen_tokens
    peak = args.batch / (args.step_ms / 1000) if args.step_ms else None
    head = (
        f"(b) worker: stub engine, {args.jobs:,} jobs x {args.gen_tokens} tokens, batch "
        f"{args.batch}, {args.step_ms:g} ms per step ("
        f"{fmt_num(peak, 0)} tok/s at a full batch)"
    )
    base = rate(tokens, direct["wall_s"])
    rows = []
    for label, r in (("direct (no Redis)", direct), ("mlxq worker", worker)):
        tps = rate(tokens, r["wall_s"])
        rows.append(
            [
                label,
                fmt_num(r["wall_s"], 2),
                fmt_num(rate(args.jobs, r["wall_s"]), 0),
                fmt_num(tps, 0),
                f"{r['steps']:,}",
                f"{100 * r['busy_s'] / r['wall_s']:.0f}%" if r["wall_s"] else "-",
                fmt_ratio(tps, base),
            ]
        )
    headers = ["run", "wall s", "jobs/s", "tok/s", "steps", "engine busy", "vs direct"]
    idle = worker["wall_s"] - worker["busy_s"]
    notes = [
        f"    mlxq worker: submit {worker['submit_s']:.2f} s + worker {worker['worker_s']:.2f} s "
        f"+ read results {worker['read_s']:.2f} s; engine idle {idle:.2f} s "
        f"({100 * idle / worker['wall_s']:.0f}% of the wall time); then the worker's exit, "
        f"not counted: {worker['worker_exit_s']:.2f} s",
        f"    worker main thread: {1000 * worker['worker_cpu_s'] / args.jobs:.2f} ms CPU per job "
        f"({worker['worker_cpu_s']:.2f} s), {fmt_num(worker['commands_per_job'], 1)} Redis "
        "commands per job",
    ]
    if worker["jobs"] != args.jobs:
        notes.append(f"!   only {worker['jobs']} of {args.jobs} jobs finished")
    return "\n".join([head, table(headers, rows), *notes])


if __name__ == "__main__":
    sys.exit(main())
