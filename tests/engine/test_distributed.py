"""One worker over several processes, on this machine over MLX's ring backend on
localhost, the model split by heads (tensor parallel, engines in lockstep) or by layers
(pipeline parallel, micro-batches in flight): both give the one-process tokens; sampling
draws the same on every rank; a rank that cannot start fails in one line naming its host.
A rank that dies, hangs or freezes: tests/faults/test_rank_faults.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from mlxq.broker import batches
from mlxq.broker.rq_store import rq_keys
from mlxq.engine.distributed.start import Hello, mismatch
from mlxq.wire import Request
from tests.helpers import free_port, run_mlxq

RANK = Path(__file__).resolve().parents[1] / "distributed_rank.py"


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama whose 6 heads split over 2 or 3 ranks."""
    from mlxq.engine.models.make import make_model

    return str(make_model(tmp_path_factory.mktemp("tp") / "tiny-tp", "tiny-tp"))


def hostfile(tmp: Path, n: int) -> Path:
    path = tmp / f"hosts{n}.json"
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(n)]))
    return path


def run_ranks(model: str, out: Path, n: int, *args: str) -> list[dict]:
    """Start ``n`` ranks of distributed_rank.py by hand (MLX_RANK, MLX_HOSTFILE) and read
    what each wrote."""
    hosts = hostfile(out.parent, n)
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK), model, str(out), *args],
            cwd=RANK.parent,
            env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)},
        )
        for r in range(n)
    ]
    assert [p.wait(120) for p in procs] == [0] * n
    return [json.loads(out.with_suffix(f".{r}").read_text()) for r in range(n)]


def run_one(model: str, out: Path, *args: str) -> dict:
    subprocess.run([sys.executable, str(RANK), model, str(out), *args], cwd=RANK.parent, check=True)
    return json.loads(out.read_text())


SPLITS = ["tensor", "pipeline"]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_split_model_gives_the_one_process_greedy_tokens(
    tp_model: str, tmp_path: Path, ranks: int, split: str
):
    """Jobs joining and finishing mid-batch (10 jobs, 4 rows; a pipeline's micro-batches of
    2 rows each) give mlx-lm's greedy tokens on every rank."""
    one = run_one(tp_model, tmp_path / "one.json")
    ref = one["reference"]  # (the one-process engine is mlx-lm's greedy; but for the JSON job)
    assert len(ref) == 10 and {k: one["tokens"][k] for k in ref} == ref
    every = run_ranks(tp_model, tmp_path / "split.json", ranks, "0", split)
    assert len(one["tokens"]) == 11 and len({len(t) for t in one["tokens"].values()}) > 1
    for got in every:
        assert got["tokens"] == one["tokens"]


@pytest.mark.parametrize("split", SPLITS)
def test_sampling_draws_the_same_on_every_rank(tp_model: str, tmp_path: Path, split: str):
    one = run_one(tp_model, tmp_path / "one.json", "0.9")
    every = run_ranks(tp_model, tmp_path / "split.json", 2, "0.9", split)
    assert every[0] == every[1]  # jobs without a seed too: rank 0 seeds them
    seeded = {k: v for k, v in one["tokens"].items() if k == "json" or int(k[3:]) % 2 == 0}
    assert {k: every[0]["tokens"][k] for k in seeded} == seeded  # seeds as in one process


def test_ranks_of_other_versions_or_files_are_refused():
    def hello(rank: int, versions: str, digest: str) -> Hello:
        return Hello(rank, f"mac{rank}", versions, "m", digest, 1 << 30, 7)

    same = [hello(0, "mlxq 1", "d"), hello(1, "mlxq 1", "d")]
    assert mismatch(same) is None
    why = mismatch([hello(0, "mlxq 1", "d"), hello(1, "mlxq 2", "d")])
    assert why is not None and "rank 1 on host mac1 runs mlxq 2" in why
    why = mismatch([*same, hello(2, "mlxq 1", "other")])
    assert why is not None and "rank 2 on host mac2 has other files" in why


def test_unknown_host_fails_in_one_line_naming_it(tp_model: str):
    done = run_mlxq("worker", "--model", tp_model, "--hosts", "127.0.0.1,no-such-host.invalid")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "host no-such-host.invalid: unknown host name" in lines[0]


def test_a_rank_alone_fails_in_one_line_naming_the_missing_one(
    tp_model: str, tmp_path: Path, valkey_url: str
):
    hosts = hostfile(tmp_path, 2)
    env = {**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hosts), "MLXQ_JOIN_TIMEOUT": "2"}
    env["MLXQ_REDIS_URL"] = valkey_url
    done = run_mlxq("worker", "--model", tp_model, "--hosts", "a,b", env=env, timeout=60)
    missing = json.loads(hosts.read_text())[1][0]
    assert done.returncode != 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"rank 1 at {missing} did not connect within 2s" in lines[0]


def submit(conn: redis.Redis, n: int, max_tokens: int) -> str:
    """``n`` jobs of varied prompts and lengths on the default queue; the batch id."""
    reqs = [
        Request(prompt=list(range(3, 3 + 2 + 5 * (i % 4))), max_tokens=max_tokens - 3 * (i % 5))
        for i in range(n)
    ]
    return batches.submit(conn, reqs, queue="default").batch_id


def once_each(conn: redis.Redis, batch_id: str, n: int) -> dict[int, list[int]]:
    """Every job finished with exactly one result; token ids by input line."""
    batches.wait_for_batch(conn, batch_id, timeout=120)
    ids = batches.batch_job_ids(conn, batch_id)
    assert len(ids) == n and [conn.xlen(rq_keys.results_key(j)) for j in ids] == [1] * n
    results = [r for r in batches.iter_batch_results(conn, batch_id) if r is not None]
    assert {r.finish_reason for r in results} <= {"length", "stop"}
    return {r.index: r.token_ids for r in results if r.index is not None}


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "ranks"), [("auto", 2), ("tensor", 2), ("auto", 3)])
def test_a_worker_over_ranks_gives_the_one_process_tokens(
    tp_model: str, conn: redis.Redis, valkey_url: str, parallel: str, ranks: int
):
    """Through the real worker: ``auto`` over ring is pipeline parallel (logged)."""
    split = submit(conn, 12, 40)
    args = ("worker", "--model", tp_model, "--max-batch", "6", "--burst", "-q", "default")
    hosts = ("--hosts", ",".join(["127.0.0.1"] * ranks), "--parallel", parallel)
    done = run_mlxq(*args, *hosts, url=valkey_url)
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = "pipeline" if parallel == "auto" else "tensor"
    assert f"{chosen} parallel over {ranks} ranks" in done.stderr, done.stderr[-3000:]
    got = once_each(conn, split, 12)
    one = submit(conn, 12, 40)
    assert run_mlxq(*args, url=valkey_url).returncode == 0
    assert got == once_each(conn, one, 12)


def test_a_lost_peer_is_the_workers_fault_not_the_jobs():
    """The slot engine fails a batch whose step raised, except where a collective lost its
    peer: that is raised, so the worker puts the jobs back (the killed-rank test, when the
    rank dies inside a step's all_sum)."""
    from mlxq.engine.faults import peer_lost

    assert peer_lost(RuntimeError("[ring] connection to a peer was lost"))
    assert peer_lost(RuntimeError("[jaccl] Send failed"))
    assert peer_lost(RuntimeError("Recv failed with errno=104"))
    assert not peer_lost(RuntimeError("[metal] out of memory"))
    assert not peer_lost(ValueError("[ring] not a collective's error"))


def test_layers_split_evenly_with_rank_0_last():
    """Rank 0 (the RQ worker) holds the last layers and the LM head, so it samples."""
    from mlxq.engine.distributed.stages import layer_spans, stage_order

    assert stage_order(2) == [1, 0] and stage_order(3) == [1, 2, 0]
    assert layer_spans(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert layer_spans(4, 2) == [(0, 2), (2, 4)]


def test_the_split_follows_the_backend_and_the_model(tp_model: str):
    """auto: pipeline over ring, tensor over jaccl, the other where the model allows only
    it; what nothing allows fails in one line that names both reasons."""
    import mlx_lm

    from mlxq.engine.distributed.split import choose_split
    from mlxq.errors import StartupError

    model = mlx_lm.load(tp_model, lazy=True)[0]  # (4 layers, 6 heads)
    assert choose_split("auto", "ring", model, 2)[0] == "pipeline"
    assert choose_split("auto", "jaccl", model, 3)[0] == "tensor"
    assert choose_split("tensor", "ring", model, 2) == ("tensor", "--parallel tensor")
    with pytest.raises(StartupError, match=r"by --parallel tensor: its num_attention_heads"):
        choose_split("tensor", "ring", model, 4)
    with pytest.raises(StartupError, match=r"not by heads .* not by layers \(a pipeline spans"):
        choose_split("auto", "ring", model, 4)
    assert choose_split("auto", "ring", model, 6)[0] == "tensor"  # (6 ranks > 4 layers)
