"""mlxq next to llama.cpp's ``llama-server`` on the same GGUF and the same chat requests.

llama-server is what a CPU user picks instead: this runs both on one machine, in one
invocation, rounds interleaved (mlxq, llama-server, mlxq, ...), and prints median gen
tok/s, prompt+gen tok/s and peak RSS side by side with the ratio mlxq / llama-server.

- mlxq runs in this process as ``throughput.py``'s ``mlxq`` mode does (submit to an
  embedded Valkey, a burst worker, results read back), the model loaded as ``mlxq worker
  --model x.gguf`` loads it, at the worker's automatic batch (``--mlxq-batch``).
- llama-server is built once from the llama.cpp sources that the ``llama-cpp-python``
  sdist vendors (``pip download``; cmake; cached under ``~/.cache/mlxq-bench``), started
  with ``-np 16`` parallel slots, and sent the same chat messages through
  ``/v1/chat/completions``, 16 requests in flight (``--clients``), greedy, the same
  ``max_tokens`` per request, ``cache_prompt`` off, stopping at EOS as users see.

Workloads: ``chat256`` (256 chat questions, ``max_tokens`` log-uniform 16..256, fixed
seed) and ``long`` (16 prompts of ~1,480 tokens, 64 out).

    python bench/llama_server.py --workloads chat256,long --repeat 3

See bench/README.md. Writes nothing but the build cache and ``--json PATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import fmt_num, fmt_ratio, table

# The llama-cpp-python sdist whose vendored llama.cpp is built (pinned: a cached build is
# found without asking the registry which version is newest).
LLAMA_CPP_PYTHON = "0.3.36"
CACHE_ENV = "MLXQ_BENCH_CACHE"
SLOTS = 16
CHAT_GEN = (16, 256)
LONG_PROMPT_TOKENS = 1480
LONG_GEN = 64
SEED = 0


# -- building llama-server -----------------------------------------------------------------
def cache_dir() -> Path:
    """``$MLXQ_BENCH_CACHE`` or ``~/.cache/mlxq-bench``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlxq-bench").expanduser()


def llama_server_binary(version: str = LLAMA_CPP_PYTHON, jobs: int = 2) -> Path:
    """The path of a ``llama-server`` built from ``llama-cpp-python==version``'s vendored
    llama.cpp: the cached one, else downloaded (``pip download``, the sdist only) and built
    with cmake under ``nice -n 19`` (tens of minutes on 2 cores; the binary is kept)."""
    home = cache_dir() / f"llama.cpp-{version}"
    binary = home / "llama-server"
    if binary.is_file():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            sys.exit(
                f"building llama-server needs {tool}: apt-get install -y cmake build-essential"
            )
    home.mkdir(parents=True, exist_ok=True)
    sdists = list(home.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not sdists:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
               ":all:", f"llama-cpp-python=={version}", "-d", str(home)]  # fmt: skip
        subprocess.run(cmd, check=True)
        sdists = list(home.glob(f"llama_cpp_python-{version}.tar.gz"))
    src = home / "src"
    if not (src / "CMakeLists.txt").is_file():
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and len(m.name) > len(prefix):
                    m.name = m.name[len(prefix) :]
                    members.append(m)
            tar.extractall(src, members=members, filter="data")
    build = home / "build"
    flags = ["-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"]  # fmt: skip
    print(f"building llama-server {version} in {build} (once) ...", file=sys.stderr)
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *flags], check=True)
    subprocess.run(
        ["nice", "-n", "19", "cmake", "--build", str(build), "--config", "Release",
         "--target", "llama-server", "-j", str(jobs)],
        check=True,
    )  # fmt: skip
    shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


# -- workloads -----------------------------------------------------------------------------
@dataclass
class ChatWorkload:
    """Chat requests both sides run: each one's messages and ``max_tokens``."""

    name: str
    label: str
    messages: list[list[dict[str, str]]]
    max_tokens: list[int]


def chat_workload(n: int = 256, seed: int = SEED) -> ChatWorkload:
    """``chat<n>``: ``real_model_agreement.py``'s questions (16 topics x 8 asks, then
    variants), ``max_tokens`` log-uniform in 16..256 (fixed seed); answers end on EOS."""
    from real_model_agreement import requests
    from workloads import log_uniform

    rng = random.Random(f"chat{n}-{seed}")
    messages = [
        [{"role": m.role, "content": m.content} for m in r.messages] for r in requests(n, 1)
    ]
    gens = [log_uniform(rng, *CHAT_GEN) for _ in range(n)]
    lo, hi = CHAT_GEN
    label = (
        f"chat{n}: {n} chat questions, max_tokens {lo}..{hi} log-uniform (mean {sum(gens) / n:.0f})"
    )
    return ChatWorkload(f"chat{n}", label, messages, gens)


SUBJECTS = (
    "The committee,A farmer,The old bridge,Our team,The river,A young engineer,"
    "The museum,The city council,A traveller,The librarian,The baker,A pilot"
).split(",")
VERBS = ("reported,noticed,repaired,described,measured,planned,questioned,recorded,visited,"
         "painted,moved,counted").split(",")  # fmt: skip
OBJECTS = ("the northern wall,a broken clock,seventeen new trees,the winter harvest,an unusual map,"
           "the water levels,a quiet garden,the train timetable,three copper bells,"
           "the lighthouse lamp,the market stalls,a lost dog").split(",")  # fmt: skip
WHEN = ("on Monday,after the storm,in early spring,before dawn,last autumn,during the festival,"
        "at noon,in the evening,twice a week,by the end of the year,without telling anyone,"
        "for the second time").split(",")  # fmt: skip


def long_message(i: int, sentences: int) -> list[dict[str, str]]:
    """Prompt ``i`` of the long workload with ``sentences`` numbered notes (deterministic)."""
    from real_model_agreement import TOPICS

    rng = random.Random(f"long-{SEED}-{i}")
    notes = [
        f"{k + 1}. {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
        f"{rng.choice(WHEN)}."
        for k in range(sentences)
    ]
    text = (
        "Here are notes from a small town's records:\n\n" + "\n".join(notes) + "\n\nWhat do "
        f"the notes say about {TOPICS[i % len(TOPICS)]} and the river? Answer in a paragraph."
    )
    return [{"role": "user", "content": text}]


def long_workload(
    count: Callable[[list[dict[str, str]]], int],
    n: int = 16,
    target: int = LONG_PROMPT_TOKENS,
    gen: int = LONG_GEN,
) -> ChatWorkload:
    """``long``: ``n`` prompts of about ``target`` tokens (``count`` gives a message
    list's templated length), ``gen`` out: the most notes whose prompt stays within it."""
    messages = []
    for i in range(n):
        lo, hi = 1, 2
        while count(long_message(i, hi)) <= target:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # count(lo) <= target < count(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if count(long_message(i, mid)) <= target else (lo, mid)
        messages.append(long_message(i, lo))
    return ChatWorkload(
        "long", f"long: {n} x ~{target:,}-token prompts + {gen} out", messages, [gen] * n
    )


# -- llama-server ------------------------------------------------------------------------------
def chat_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One ``/v1/chat/completions`` request: greedy, no prompt reuse between requests
    (``cache_prompt`` off: a round would otherwise find the last round's prompts cached),
    EOS on."""
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "seed": SEED,
        "cache_prompt": False,
        "stream": False,
    }


def context_size(prompt_lengths: Sequence[int], max_tokens: Sequence[int], slots: int) -> int:
    """``-c`` for ``slots`` slots: each holds the longest request (rounded up to 256)."""
    longest = max(p + m for p, m in zip(prompt_lengths, max_tokens, strict=True)) + 16
    return slots * (-(-longest // 256) * 256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A ``llama-server`` process for the block (``with``): started, healthy, stopped."""

    def __init__(self, binary: Path, model: str, slots: int, ctx: int, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        help_text = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
        self.args = [
            "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
            "-c", str(ctx), "-t", str(threads), "-tb", str(threads), "--jinja",
        ]  # fmt: skip
        for flag, value in (("--no-webui", None), ("--cache-ram", "0")):  # where it has them
            if re.search(rf"(^|[\s,]){flag}[\s,]", help_text):
                self.args += [flag] if value is None else [flag, value]
        self.command = [str(binary), *self.args]
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"llama-server exited ({self.proc.returncode}): see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.__exit__()
        sys.exit(f"llama-server not healthy after 300 s: see {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """One completion (blocking)."""
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.url}/v1/chat/completions", data, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())


# -- one side's run --------------------------------------------------------------------------
@dataclass
class SideRun:
    """One timed run of a workload by one side."""

    side: str
    wall_s: float
    prompt_tokens: int
    gen_tokens: int
    peak_rss: int | None = None  # bytes
    eos: int | None = None  # answers that ended on EOS (llama-server's finish_reason)
    errors: int = 0
    cpu_s: float | None = None  # CPU seconds the side's process used (all its threads)
    load: float | None = None  # the machine's 1-minute load average at the end
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.gen_tokens) / self.wall_s

    @property
    def gen_per_cpu_s(self) -> float | None:
        return self.gen_tokens / self.cpu_s if self.cpu_s else None


def cpu_seconds(pid: int | str = "self") -> float | None:
    """User + system CPU seconds of a process, all its threads (``/proc/PID/stat``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_llama(server: LlamaServer, wl: ChatWorkload, clients: int) -> SideRun:
    """Every request of ``wl``, ``clients`` in flight at once (the server's slots)."""
    from common import peak_rss_bytes, reset_peak_rss

    bodies = [chat_body(m, k) for m, k in zip(wl.messages, wl.max_tokens, strict=True)]
    reset_peak_rss(server.pid)
    cpu = cpu_seconds(server.pid)
    tic = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(server.chat, bodies))
    wall = time.perf_counter() - tic
    cpu = _delta(cpu_seconds(server.pid), cpu)
    usage = [a["usage"] for a in answers]
    run = SideRun(
        "llama-server",
        wall,
        sum(u["prompt_tokens"] for u in usage),
        sum(u["completion_tokens"] for u in usage),
        peak_rss_bytes(server.pid),
        sum(a["choices"][0]["finish_reason"] == "stop" for a in answers),
        cpu_s=cpu,
        load=os.getloadavg()[0],
    )
    timings = [a.get("timings") or {} for a in answers]
    run.extra["prompt_ms"] = sum(t.get("prompt_ms", 0.0) for t in timings)
    run.extra["predicted_ms"] = sum(t.get("predicted_ms", 0.0) for t in timings)
    run.extra["prompt_lengths"] = [u["prompt_tokens"] for u in usage]
    return run


def run_mlxq_side(
    model: Any, tokenizer: Any, name: str, wl: Any, profile: Any, url: str
) -> SideRun:
    """``wl`` (token ids: the chat template applied by mlxq's encoder) through mlxq as
    ``throughput.py``'s ``mlxq`` mode runs it; EOS on."""
    from common import peak_rss_bytes, reset_peak_rss
    from modes import fresh_memory, run_mlxq

    fresh_memory()
    reset_peak_rss()
    cpu = cpu_seconds()
    result = run_mlxq(model, tokenizer, name, wl, profile, url)
    cpu = _delta(cpu_seconds(), cpu)
    run = SideRun(
        "mlxq", result.wall_s, wl.prompt_tokens, result.gen_tokens, peak_rss_bytes(), None,
        result.errors, cpu, os.getloadavg()[0],
    )  # fmt: skip
    run.extra = {**result.extra, "mlx_peak_gb": result.peak_gb}
    return run


def _delta(after: float | None, before: float | None) -> float | None:
    return after - before if after is not None and before is not None else None


def wait_for_quiet(limit: float | None, most_s: float = 600) -> None:
    """Wait (up to ``most_s``) until the machine's 1-minute load average is under
    ``limit``: a shared machine's other work slows a nice process unevenly."""
    if limit is None:
        return
    deadline = time.monotonic() + most_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)


# -- report --------------------------------------------------------------------------------
def median_of(runs: Sequence[SideRun], value: Callable[[SideRun], float]) -> float:
    return statistics.median(value(r) for r in runs)


def _median_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def side_table(mlxq: Sequence[SideRun], llama: Sequence[SideRun]) -> str:
    """mlxq and llama-server side by side (medians over rounds; peak RSS the most of any
    round), then their ratio; a side that did not run (``--sides``) is left out, and the
    ratio with it."""
    rows, figures = [], {}
    for name, runs in (("mlxq", mlxq), ("llama-server", llama)):
        if not runs:
            continue
        rss = [r.peak_rss for r in runs if r.peak_rss]
        eos = [r.eos for r in runs if r.eos is not None]
        f = {
            "gen": median_of(runs, lambda r: r.gen_tps),
            "total": median_of(runs, lambda r: r.total_tps),
            "wall": median_of(runs, lambda r: r.wall_s),
            "rss": max(rss) / 1e9 if rss else None,
            "cpu": _median_or_none([r.gen_per_cpu_s for r in runs]),
            "load": _median_or_none([r.load for r in runs]),
        }
        figures[name] = f
        rows.append([
            name, fmt_num(f["gen"]), fmt_num(f["total"]), fmt_num(f["wall"], 2),
            f"{runs[0].prompt_tokens:,}", f"{round(median_of(runs, lambda r: r.gen_tokens)):,}",
            f"{eos[0]:,}" if eos else "-", fmt_num(f["rss"], 2), fmt_num(f["cpu"], 1),
            fmt_num(f["load"], 1), " ".join(f"{r.gen_tps:.1f}" for r in runs),
        ])  # fmt: skip
    if len(figures) == 2:
        m, ll = figures["mlxq"], figures["llama-server"]
        rows.append([
            "mlxq / llama-server", fmt_ratio(m["gen"], ll["gen"]),
            fmt_ratio(m["total"], ll["total"]), fmt_ratio(m["wall"], ll["wall"]), "", "", "",
            fmt_ratio(m["rss"], ll["rss"]), fmt_ratio(m["cpu"], ll["cpu"]), "", "",
        ])  # fmt: skip
    head = [
        "side",
        "gen tok/s",
        "prompt+gen tok/s",
        "wall s",
        "prompt tok",
        "gen tok",
        "ended on EOS",
        "peak RSS GB",
        "gen tok/CPU-s",
        "load",
        "gen tok/s by round",
    ]
    return table(head, rows)


# -- main ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="the GGUF (default: the test tier's SmolLM2-135M Q4_1)")
    p.add_argument("--workloads", default="chat256,long", help="chat<N> and/or long")
    p.add_argument("--long-requests", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=LONG_PROMPT_TOKENS)
    p.add_argument("--repeat", type=int, default=3, help="rounds, each side once a round")
    p.add_argument("--slots", type=int, default=SLOTS, help="llama-server -np")
    p.add_argument("--clients", type=int, help="requests in flight (default: --slots)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON, help="the sdist to build")
    p.add_argument("--llama-server", help="a llama-server binary instead of the cached build")
    p.add_argument("--build-only", action="store_true", help="build (or find) it and exit")
    p.add_argument("--sides", default="mlxq,llama", help="mlxq and/or llama")
    p.add_argument("--mlxq-batch", type=int, help="mlxq's max batch (default: the worker's)")
    p.add_argument("--prefill-step", type=int, default=2048, help="mlxq's prefill chunk")
    p.add_argument("--prefill-batch", type=int, help="mlxq's prompts per prefill call")
    p.add_argument("--dequantize", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--kv-bits", type=int, choices=(8, 4), help="mlxq's quantized KV cache")
    p.add_argument("--redis-url", help="instead of an embedded Valkey")
    p.add_argument(
        "--wait-load",
        type=float,
        metavar="X",
        help="before each run wait (up to 10 minutes) for a 1-minute load average under X",
    )
    p.add_argument("--json", help="also write the figures here")
    return p.parse_args(argv)


def default_gguf() -> str:
    """The test tier's GGUF (``tests/real_model.py`` fetches it with pip on first use)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from real_model import fetch_gguf

    return str(fetch_gguf())


def main(argv: list[str] | None = None) -> int:
    from common import (
        describe_device,
        git_commit,
        load_as_worker,
        quiet_logs,
        redis_url,
        set_up_like_mlxq,
        write_json,
    )

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (stops llama-server too)
    binary = Path(args.llama_server) if args.llama_server else None
    sides = args.sides.split(",")
    if binary is None and ("llama" in sides or args.build_only):
        binary = llama_server_binary(args.llama_cpp_python)
    if args.build_only:
        print(binary)
        return 0
    set_up_like_mlxq()
    quiet_logs()
    import mlx.core as mx
    from workloads import Workload

    from mlxq.engine.models.facts import model_info
    from mlxq.engine.prompts import PromptEncoder
    from mlxq.wire import Message, Request
    from mlxq.worker.config import resolve
    from mlxq.worker.profile import WorkerProfile

    gguf = args.model or default_gguf()
    name = Path(gguf).name
    model, tokenizer, facts = load_as_worker(gguf, args.dequantize)
    mx.eval(model.parameters())  # here: MLX's streams are per thread, the engine's its own
    info = model_info(model, name, vocab_size=len(tokenizer))
    encoder = PromptEncoder(tokenizer, info)

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return encoder.prompt_tokens(Request(messages=[Message(**m) for m in messages]))

    chats = []
    for kind in args.workloads.split(","):
        if kind == "long":
            count = lambda m: len(encode(m))  # noqa: E731
            chats.append(long_workload(count, args.long_requests, args.long_tokens))
        elif kind.startswith("chat"):
            chats.append(chat_workload(int(kind.removeprefix("chat") or 256)))
        else:
            sys.exit(f"unknown workload {kind!r}: chat<N> or long")
    profile = WorkerProfile(
        max_batch=args.mlxq_batch,
        prefill_step=args.prefill_step,
        prefill_batch=args.prefill_batch,
        kv_bits=args.kv_bits,
    )
    batch = resolve(profile, facts, info).max_batch  # what run_mlxq's worker admits
    clients = args.clients or args.slots
    device, commit = describe_device(), git_commit()
    out: dict[str, Any] = {"model": name, "device": device, "commit": commit, "workloads": []}
    with redis_url(args.redis_url) as url:
        for chat in chats:
            prompts = [encode(m) for m in chat.messages]
            wl = Workload(chat.name, chat.label, prompts, list(chat.max_tokens))
            ctx = context_size([len(p) for p in prompts], chat.max_tokens, args.slots)
            runs: dict[str, list[SideRun]] = {"mlxq": [], "llama": []}
            server = LlamaServer(binary, gguf, args.slots, ctx, args.threads) if binary else None
            with server or contextlib.nullcontext():
                warm(sides, model, tokenizer, name, wl, chat, profile, url, server)
                for i in range(args.repeat):
                    for side in sides:
                        wait_for_quiet(args.wait_load)
                        print(f"{chat.name}: {side} ({i + 1}/{args.repeat}) ...", file=sys.stderr)
                        if side == "mlxq":
                            runs[side].append(
                                run_mlxq_side(model, tokenizer, name, wl, profile, url)
                            )
                        else:
                            runs[side].append(run_llama(server, chat, clients))
                        last = runs[side][-1]
                        print(
                            f"  {last.gen_tps:.1f} gen tok/s, {last.wall_s:.1f} s, "
                            f"{last.cpu_s or 0:.0f} CPU-s, load {last.load:.1f}",
                            file=sys.stderr,
                        )
            flags = " ".join(server.args[2:]) if server else "-"
            print()
            print(
                f"{name} on {device}, {args.threads} threads, commit {commit} | {chat.label} | "
                f"mlxq: batch {batch}, prefill step {args.prefill_step}, "
                f"weights {args.dequantize}, KV {args.kv_bits or 'model dtype'} | "
                f"llama-server: {flags}"
                f" | {clients} clients | median of {args.repeat} rounds, interleaved"
            )
            print(side_table(runs["mlxq"], runs["llama"]))
            out["workloads"].append(
                {"name": chat.name, "label": chat.label, "llama_ctx": ctx, "mlxq_batch": batch,
                 "runs": {k: [dataclasses.asdict(r) for r in v] for k, v in runs.items()}}
            )  # fmt: skip
            sys.stdout.flush()
    if args.json:
        write_json(args.json, out)
    return 0


def warm(
    sides: list[str], model: Any, tokenizer: Any, name: str, wl: Any, chat: ChatWorkload,
    profile: Any, url: str, server: LlamaServer | None,
) -> None:  # fmt: skip
    """Each side once on the first 16 requests at 8 tokens, untimed."""
    short = dataclasses.replace(
        wl, prompts=wl.prompts[:16], max_tokens=[8] * min(16, len(wl.prompts))
    )
    if "mlxq" in sides:
        run_mlxq_side(model, tokenizer, name, short, profile, url)
    if server is not None:
        bodies = [chat_body(m, 8) for m in chat.messages[:16]]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(server.chat, bodies))


if __name__ == "__main__":
    sys.exit(main())
