"""Benchmark scripts still run: their short modes, as a user would start them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT


def run_script(*args: str) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT ARGS`` from the checkout; fails the test on a non-zero exit."""
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out


def test_queue_overhead_short_mode_runs(valkey_url: str) -> None:
    # The stub engine behind a real worker and Redis: the script must keep up with the
    # engine interface (it once lacked take_stream and prefill_length and stopped running).
    out = run_script("bench/queue_overhead.py", "--short", "--redis-url", valkey_url)
    assert "(a) submit: 200 jobs" in out.stdout
    assert "mlxq worker" in out.stdout and "only" not in out.stdout


def test_throughput_runs_a_varied_workload_and_its_twin(valkey_url: str, tmp_path: Path) -> None:
    out = run_script(
        "bench/throughput.py",
        *("--preset", "tiny", "--requests", "6", "--batch", "2"),
        *("--workload", "varied,varied-twin", "--modes", "raw,mlxq,mlxq-bg,mlxq-direct"),
        *("--redis-url", valkey_url, "--export-jsonl", str(tmp_path)),
    )
    assert "varied vs its uniform twin (gen tok/s): raw" in out.stdout
    assert "positions a token attends" in out.stdout
    assert "!" not in out.stdout  # every mode returned every token
    lines = (tmp_path / "varied.jsonl").read_text().splitlines()
    assert len(lines) == 6 and '"custom_id": "r0"' in lines[0]


def test_throughput_sweeps_batch_sizes_side_by_side(valkey_url: str, tmp_path: Path) -> None:
    figures = tmp_path / "sweep.json"
    out = run_script(
        "bench/throughput.py",
        *("--preset", "tiny", "--requests", "8", "--batch", "2,4,auto"),
        *("--workload", "varied", "--modes", "raw,mlxq", "--prompt-tokens", "16"),
        *("--redis-url", valkey_url, "--json", str(figures)),
    )
    assert "!" not in out.stdout  # every size returned every token
    assert "batch sweep on varied (8 requests)" in out.stdout
    sweep = out.stdout.split("batch sweep on varied")[1]
    for row in ("raw@2", "raw@4", "mlxq@2", "mlxq@4"):
        assert f"\n{row} " in sweep
    assert sweep.count("1.00x") == 2  # each mode against its first size
    assert "batch 2: set by --max-batch" in out.stderr  # the worker's line, size by size
    data = json.loads(figures.read_text())
    auto = data["batches"][2]
    assert [b["batch"] for b in data["batches"][:2]] == [2, 4]
    assert auto["source"].startswith("auto: ")
    assert auto["why"].startswith(f"batch up to {auto['batch']}")
    (workload,) = data["workloads"]
    modes = {m["mode"]: m for m in workload["modes"]}
    assert modes["mlxq@2"]["gen_tokens"] == modes[f"mlxq@{auto['batch']}"]["gen_tokens"]
    assert modes["mlxq@4"]["decode_steps"] < modes["mlxq@2"]["decode_steps"]


def test_throughput_batch_list_is_checked() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from throughput_sweep import parse_batches

    assert parse_batches("256,auto, 1024") == [256, None, 1024]
    assert parse_batches(None) == [None]
    for bad, why in (("0", "below 1"), ("x", "'x' is not a batch size"), ("4,4", "twice")):
        with pytest.raises(ValueError, match=why):
            parse_batches(bad)


def test_constraints_runs_its_modes_alternating_and_interleaved(tmp_path: Path) -> None:
    figures = tmp_path / "constraints.json"
    run_script(
        "bench/constraints.py",
        *("--preset", "tiny", "--batches", "4", "--repeat", "1", "--interleave", "3"),
        *("--max-tokens", "24", "--json", str(figures)),
    )
    (row,) = json.loads(figures.read_text())["rows"]
    assert row["interleaved"]["free_s"] > 0 and row["interleaved"]["json_s"] > 0
    assert row["interleaved"]["json_per_free"] > 0 and row["json"]["tok_s"] > 0


def test_sampling_launch_times_every_part() -> None:
    out = run_script(
        "bench/sampling_launch.py",
        *("--rows", "4", "--vocab", "320", "--distinct", "2", "--warmup", "1", "--repeat", "2"),
    )
    for part in ("free", "upload", "upload + apply", "masked"):
        assert f"\n{part} " in out.stdout, out.stdout


def test_context_per_token_counts_the_positions_each_token_attends() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from workloads import context_per_token

    # Prompt 10, 3 tokens: they attend 10, 11 and 12 positions.
    assert context_per_token([10], [3]) == 11
    # Same prompts and mean output: the varied outputs' tokens attend longer contexts.
    assert context_per_token([10, 10], [1, 5]) > context_per_token([10, 10], [3, 3])


def test_n_samples_runs_each_mode_on_both_cases(tmp_path: Path) -> None:
    figures = tmp_path / "n.json"
    run_script(
        "bench/n_samples.py",
        *("--preset", "tiny", "--prompts", "6", "--n", "3", "--batch", "6"),
        *("--prompt-tokens", "40", "--decode-out", "6", "--json", str(figures)),
    )
    results = json.loads(figures.read_text())["results"]
    assert [r["case"] for r in results] == ["prefill", "decode"]
    for r in results:
        assert r["same"]  # n samples are the separate submissions' samples, token for token
        assert all(r[mode]["median_wall_s"] > 0 for mode in ("n", "separate", "separate+prefix"))


def test_real_model_agreement_and_long_prompt_memory_run(tiny_model: str) -> None:
    """The scripts behind the CPU figures in bench/RESULTS.md, small, on the tiny model's folder."""
    small = ("--requests", "6", "--max-tokens", "6", "--reference", "2")
    agree = run_script("bench/real_model_agreement.py", "--model", tiny_model, *small)
    got = json.loads(agree.stdout.strip().splitlines()[-1])
    assert got["sorted_equal_unsorted"] == 6 and got["equal_to_mlx_lm"] == 2, got
    short = ("--prompt-tokens", "300", "--max-tokens", "4")
    memory = run_script("bench/long_prompt_memory.py", "--model", tiny_model, *short)
    got = json.loads(memory.stdout.strip().splitlines()[-1])
    assert got["same_tokens"] and got["ratio"] <= 2, got


def test_step_floor_times_the_parts_and_prints_the_roofline_bound() -> None:
    out = run_script(
        "bench/step_floor.py",
        *("--preset", "tiny", "--rows", "2,8", "--span", "32", "--mean-length", "8"),
        *("--repeat", "1", "--chain", "1", "--steps", "2"),
    )
    assert "milliseconds per decode step" in out.stdout
    assert "roofline bound" in out.stdout and "end to end" in out.stdout


def test_the_roofline_bound_is_the_weight_read_against_the_flops() -> None:
    # 1,000 weights (tied: the embedding is the head), no KV: a token's 2,000 FLOPs at 1e12
    # FLOP/s take 2 ns; a step reads 2,000 bytes at 1e9 B/s (2 us) whatever its rows. So
    # 10 rows cost 200 ns a token: at most 100x; 1,000 rows are at their FLOPs: 1x.
    sys.path.insert(0, str(ROOT / "bench"))
    from step_floor import Roofline

    class Model:
        def parameters(self) -> dict:
            import mlx.core as mx

            return {"w": mx.zeros((1000,))}

    cfg = {"hidden_size": 10, "vocab_size": 10, "num_attention_heads": 1}
    cfg |= {"num_hidden_layers": 0, "tie_word_embeddings": True}
    cost = Roofline(Model(), cfg, kv_token=0, mean=0, tflops=1.0, gbs=1.0)
    assert cost.step_ms(10) == pytest.approx(2e-3)
    assert cost.bound(10, prompt=0, output=1)[3:] == ["100.00x", "100.00x"]
    assert cost.bound(1000, prompt=0, output=1)[3:] == ["1.00x", "1.00x"]
    # A prompt of 900 tokens at 1,800 FLOPs each (the head's 200 not counted) adds 1.62 us
    # to both: (1.62 + 0.2) / (1.62 + 0.002) = 1.12x end to end.
    assert cost.bound(10, prompt=900, output=1)[4] == "1.12x"


def test_llama_server_bench_builds_the_same_requests_and_a_side_by_side_table() -> None:
    # The pure-Python parts of bench/llama_server.py: no llama.cpp build, no model.
    sys.path.insert(0, str(ROOT / "bench"))
    from llama_server import (
        SideRun,
        chat_body,
        chat_workload,
        context_size,
        long_message,
        long_workload,
        side_table,
    )

    chat = chat_workload(256)
    assert chat.name == "chat256" and len(chat.messages) == len(chat.max_tokens) == 256
    assert all(16 <= m <= 256 for m in chat.max_tokens) and len(set(chat.max_tokens)) > 50
    assert chat_workload(256) == chat  # seeded: every run, every side the same
    assert len({m[0]["content"] for m in chat.messages}) == 256  # no two prompts alike

    # Long prompts: the most notes whose templated length stays within the target.
    def words(messages: list[dict[str, str]]) -> int:
        return 20 + len(messages[0]["content"].split())

    long = long_workload(words, n=3, target=500, gen=64)
    assert len(long.messages) == 3 and long.max_tokens == [64] * 3
    for i, m in enumerate(long.messages):
        notes = m[0]["content"].count("\n") - 3
        assert words(m) <= 500 < words(long_message(i, notes + 1))
    assert long.messages[0] != long.messages[1]

    body = chat_body(chat.messages[0], 17)
    assert body["max_tokens"] == 17 and body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["cache_prompt"] is False  # rounds must not find the last round's prompts
    assert context_size([100, 1480], [256, 64], slots=16) == 16 * 1792

    mlxq = [
        SideRun("mlxq", 10.0, 1000, 500, 3_000_000_000, cpu_s=20.0),
        SideRun("mlxq", 20.0, 1000, 500, cpu_s=20.0),
    ]
    llama = [SideRun("llama-server", 5.0, 1000, 500, 1_000_000_000, eos=7, cpu_s=10.0)] * 2
    out = side_table(mlxq, llama)
    ratio = out.splitlines()[-1].split()
    assert ratio[:3] == ["mlxq", "/", "llama-server"]
    # medians: mlxq 37.5 gen tok/s (50 and 25), llama 100; RSS: the most of any round;
    # tokens per CPU second 25 against 50
    assert ratio[3:5] == ["0.38x", "0.38x"] and ratio[-2:] == ["3.00x", "0.50x"]
    assert "50.0 25.0" in out and "   7   " in out
    alone = side_table(mlxq, []).splitlines()  # (--sides mlxq: its own rows, no ratio)
    assert len(alone) == 2 and alone[1].split()[:2] == ["mlxq", "37.5"]
