"""The real model on prompts of several hundred tokens: on the CPU their prefill attends in
blocks of query rows (mlxq.engine.slots.causal_blocks), and the answers stay mlx-lm's
single-request greedy ones, token for token, and read as answers."""

from __future__ import annotations

from engine_reference import record_block_widths, reference
from engine_reference import run_all as run
from real_model import smollm, smollm_gguf  # noqa: F401 - fixtures

from mlxq.engine.factory import make_engine
from mlxq.engine.slots.causal_blocks import BLOCK_ENV, CPU_BLOCK
from mlxq.wire import Message, Request

TOWNS = ["Ashford", "Bramley", "Corwen", "Dunmore", "Elsworth", "Fenwick", "Glenrock", "Harlow"]
STORY = " ".join(
    f"The town of {town} lies by a river. Its market opens every morning, and its people "
    "grow apples, pears and plums. The bakery in "
    f"{town} sells bread, cakes and pies to travellers who pass through on the old road."
    for town in TOWNS
)


def test_long_prompts_keep_mlx_lm_s_tokens_and_answer(smollm, monkeypatch) -> None:  # noqa: F811
    """Two questions after a ~430-token story (several blocks of the CPU's default size)
    and a short one, joining a step apart: mlx-lm's tokens; the bakery's goods named."""
    monkeypatch.delenv(BLOCK_ENV, raising=False)
    model, tokenizer = smollm
    asks = {"bakery": "What does the bakery sell?", "fruit": "What fruits do people grow?"}
    jobs = {
        k: Request(messages=[Message("user", f"{STORY} {q}")], max_tokens=24)
        for k, q in asks.items()
    }
    jobs["short"] = Request(messages=[Message("user", "What is 2 + 2?")], max_tokens=12)
    widths = record_block_widths(monkeypatch)
    engine = make_engine(model, tokenizer, "smollm", max_batch=4)
    done = run(engine, jobs, join_every=1)
    if engine.choices.prefill_block:  # (the CPU's default; MLX's GPU kernels skip the mask)
        assert engine.choices.prefill_block == CPU_BLOCK and max(widths) > 3 * CPU_BLOCK
    for key, request in jobs.items():
        tokens = engine.encode(request)
        assert key == "short" or len(tokens) > 400, len(tokens)
        assert done[key].token_ids == reference(model, tokenizer, tokens, request)["tokens"], key
    assert "bread" in done["bakery"].text, done["bakery"].text
