"""Scale: what a 100,000-job batch costs Redis and the commands that read it.

Submits a big and a small batch to an embedded Valkey, ends every job of both with a
realistic Result (written as a worker writes it: ``rq_store.transitions.end_job``, no
model needed), then measures side by side: ``batch_status`` (counters) against counting
job by job, ``mlxq results`` (a real process writing JSONL) for both sizes, with its peak
RSS, and Redis memory per queued and per finished job (for docs/operating.md's sizing).

    python bench/scale.py --jobs 100000 --small 10000
"""

from __future__ import annotations

import argparse
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rq.job import Job

from mlxq.broker import batches as broker_batches
from mlxq.broker.rq_store import transitions
from mlxq.broker.serializer import serializer
from mlxq.server import embedded
from mlxq.wire import Request, Result, Timing, Usage

ROOT = Path(__file__).resolve().parent.parent


def requests(n: int) -> list[Request]:
    rng = random.Random(n)
    words = "the quick brown fox jumps over a lazy dog near the river bank".split()
    return [
        Request(
            prompt=" ".join(rng.choice(words) for _ in range(rng.randint(8, 200))),
            max_tokens=rng.randint(16, 512),
            custom_id=f"req-{i}",
        )
        for i in range(n)
    ]


def finish_all(conn, batch_id: str) -> None:
    """End every job with a Result of 16-512 tokens, as a worker writes it."""
    rng = random.Random(0)
    for ids in broker_batches.iter_job_id_chunks(conn, batch_id):
        jobs = Job.fetch_many(ids, connection=conn, serializer=serializer)
        with conn.pipeline() as pipe:
            for job in jobs:
                n = rng.randint(16, 512)
                result = Result(
                    job_id=job.id,
                    custom_id=job.meta.get("custom_id"),
                    finish_reason="length" if n % 3 else "stop",
                    text="word " * n,
                    token_ids=[rng.randrange(32000) for _ in range(n)],
                    usage=Usage(100, n, 100 + n),
                    model="bench",
                    worker="bench",
                    batch_id=batch_id,
                    index=job.meta.get("index"),
                    timing=Timing(started_at=time.time(), finished_at=time.time()),
                )
                transitions.end_job(pipe, job, broker_batches.make_queue(conn, job.origin), result)
            pipe.execute()


def plain_enqueue(conn, reqs: list[Request], queue: str) -> None:
    """What submitting cost before batch records came first and counters were kept: RQ's
    enqueue_many and the id list, pipelined per 1,000 (the baseline)."""
    q_ = broker_batches.make_queue(conn, queue)
    for at in range(0, len(reqs), broker_batches.CHUNK):
        datas = [
            q_.prepare_data("mlxq.jobs.generate", args=(r.prompt,), result_ttl=600)
            for r in reqs[at : at + broker_batches.CHUNK]
        ]
        with conn.pipeline() as pipe:
            jobs = q_.enqueue_many(datas, pipeline=pipe)
            pipe.rpush("mlxq:bench:ids", *[j.id for j in jobs])
            pipe.execute()


def timed(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def results_cli(url: str, batch_id: str, out: Path) -> tuple[float, float]:
    """(seconds, peak RSS MiB) of `mlxq results BATCH -o OUT` as its own process."""
    code = (
        "import resource, sys; from mlxq.cli.main import cli\n"
        "try:\n    cli(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
        "    raise\n"
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, "results", batch_id, "-o", str(out), "--redis-url", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - start
    return seconds, int(proc.stderr.strip().splitlines()[-1]) / 1024


def status_cli(url: str, batch_id: str, repeat: int = 20) -> float:
    """Median seconds of `mlxq status BATCH --json` run in this process (connecting and
    the unaccounted-jobs check included; no interpreter start)."""
    from click.testing import CliRunner

    from mlxq.cli.status import status

    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        done = CliRunner().invoke(status, [batch_id, "--json", "--redis-url", url])
        times.append(time.perf_counter() - start)
        assert done.exit_code == 0, done.output
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--small", type=int, default=10_000, help="the batch to compare with")
    ap.add_argument("--tiny", type=int, default=10, help="the batch whose status is the baseline")
    ap.add_argument("--out", default="/tmp/mlxq-scale.jsonl")
    args = ap.parse_args()
    with embedded() as url:
        conn = broker_batches.connect(url)
        sizes = {"big": args.jobs, "small": args.small, "tiny": args.tiny}
        batches, submit_s = {}, {}
        for name, n in sizes.items():
            reqs = requests(n)
            before = conn.info("memory")["used_memory"]
            start = time.perf_counter()
            batches[name] = broker_batches.submit(conn, reqs, queue=name).batch_id
            submit_s[name] = time.perf_counter() - start
            if name == "big":
                queued_bytes = (conn.info("memory")["used_memory"] - before) / n
        reqs = requests(args.small)
        start = time.perf_counter()
        plain_enqueue(conn, reqs, "plain")
        plain_rate = args.small / (time.perf_counter() - start)
        start = time.perf_counter()
        broker_batches.submit(conn, reqs, queue="same")
        same_rate = args.small / (time.perf_counter() - start)
        status = {
            k: timed(lambda b=b: broker_batches.batch_status(conn, b), 50)
            for k, b in batches.items()
        }
        command = {k: status_cli(url, batches[k]) for k in ("big", "tiny")}
        counted = timed(lambda: broker_batches.count_jobs(conn, batches["big"]), 1)
        before = conn.info("memory")["used_memory"]
        start = time.perf_counter()
        finish_all(conn, batches["big"])
        finish_s = time.perf_counter() - start
        finished_bytes = (conn.info("memory")["used_memory"] - before) / args.jobs + queued_bytes
        finish_all(conn, batches["small"])
        read = {k: results_cli(url, batches[k], Path(args.out)) for k in ("big", "small")}
        lines = sum(1 for _ in open(args.out))  # the small batch's file, written last
        assert lines == args.small, lines
        assert broker_batches.batch_status(conn, batches["big"]).finished == args.jobs
    big, small = read["big"], read["small"]
    print(
        f"scale: {args.jobs:,} jobs (prompts 8-200 words, results 16-512 tokens), embedded Valkey"
    )
    print(
        f"  submit: {args.jobs / submit_s['big']:,.0f} jobs/s; of {args.small:,} jobs, side by "
        f"side: {same_rate:,.0f} jobs/s vs {plain_rate:,.0f} with plain RQ enqueue_many "
        f"({same_rate / plain_rate:.2f}x)"
    )
    print(
        f"  Redis memory: {queued_bytes:,.0f} B per queued job, "
        f"{finished_bytes:,.0f} B per job with its result"
    )
    print(
        f"  batch_status: {status['big'] * 1e3:.2f} ms for {args.jobs:,} jobs, "
        f"{status['tiny'] * 1e3:.2f} ms for {args.tiny} ({status['big'] / status['tiny']:.2f}x); "
        f"counting job by job: {counted:.2f} s ({counted / status['big']:,.0f}x the counters)"
    )
    print(
        f"  mlxq status --json (in process, its unaccounted-jobs check included): "
        f"{command['big'] * 1e3:.1f} ms for {args.jobs:,} queued jobs, "
        f"{command['tiny'] * 1e3:.1f} ms for {args.tiny}"
    )
    print(f"  ending {args.jobs:,} jobs as a worker does: {args.jobs / finish_s:,.0f} jobs/s")
    print(
        f"  mlxq results: {args.jobs / big[0]:,.0f} results/s for {args.jobs:,} "
        f"(peak RSS {big[1]:.0f} MiB); {args.small / small[0]:,.0f} results/s for "
        f"{args.small:,} (peak RSS {small[1]:.0f} MiB)"
    )
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  (this process: peak RSS {own:.0f} MiB)")


if __name__ == "__main__":
    main()
