"""A prefill's causal attention in blocks of query rows (mlxq.engine.slots.causal_blocks):
the attention of one call, block by block; through the engine, mlx-lm's single-request
greedy tokens for prompts several blocks long, in chunks, after a stored prefix and with
samples; and its settings."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from engine_reference import record_block_widths, reference, run_all

from mlxq.engine.slots import causal_blocks
from mlxq.engine.slots.causal_blocks import BLOCK_ENV, BlockedCache, choose_block
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.slots.joins import JoinPolicy
from mlxq.engine.slots.prefill_streams import STREAMS_ENV
from mlxq.engine.slots.softmax import SOFTMAXES
from mlxq.wire import Request


def _filled(block: int, prefix: int, rows: int, heads: int = 2) -> tuple[BlockedCache, mx.array]:
    """A cache holding ``prefix`` positions, then ``rows`` more (the chunk), and the
    chunk's queries (4 query heads over ``heads`` KV heads)."""
    mx.random.seed(3)
    k, v = (mx.random.normal((2, heads, prefix + rows, 16)) for _ in range(2))
    cache = BlockedCache(block)
    if prefix:
        cache.update_and_fetch(k[:, :, :prefix], v[:, :, :prefix])
    cache.update_and_fetch(k[:, :, prefix:], v[:, :, prefix:])
    return cache, mx.random.normal((2, 4, rows, 16))


@pytest.mark.parametrize("softmax", ["mlx", "pow2"])
@pytest.mark.parametrize(("prefix", "rows"), [(0, 70), (45, 64), (30, 17), (0, 1)])
def test_blocks_attend_as_one_causal_call(
    monkeypatch, prefix: int, rows: int, softmax: str
) -> None:
    """Blocks of 16 query rows, after a prefix or none, with either softmax: MLX's one
    call's output, each block over the keys up to its last query only."""
    cache, q = _filled(16, prefix, rows)
    cache.softmax = SOFTMAXES[softmax]
    keys, values = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.25, mask="causal")
    seen: list[tuple[int, int]] = []
    plain = causal_blocks.causal_attention

    def spy(q: mx.array, k: mx.array, *args: Any) -> mx.array:
        seen.append((q.shape[2], k.shape[2]))
        return plain(q, k, *args)

    monkeypatch.setattr(causal_blocks, "causal_attention", spy)
    got = cache.attend(q, 0.25, "causal")
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()
    blocks = [(lo, min(rows, lo + 16)) for lo in range(0, rows, 16)] if rows > 16 else [(0, rows)]
    assert seen == [(hi - lo, prefix + hi) for lo, hi in blocks]


def test_a_mask_other_than_causal_attends_in_one_call() -> None:
    """An array mask (or none, one token) is the model's own: passed to one call as it is."""
    cache, q = _filled(8, 10, 40)
    keys, values = cache.keys[..., :50, :], cache.values[..., :50, :]
    mask = mx.random.uniform(shape=(40, 50)) > 0.3
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.5, mask=mask)
    assert mx.array_equal(cache.attend(q, 0.5, mask), want).item()


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * n + salt) % 400 + 3 for i in range(n)]


def _run(tiny: Any, monkeypatch: Any, block: str, jobs: dict[str, Request], **options: Any):
    monkeypatch.setenv(BLOCK_ENV, block)
    monkeypatch.setenv(STREAMS_ENV, "2")  # (the CPU's default: each part in blocks)
    engine = SlotEngine.from_loaded(*tiny, "tiny", max_batch=16, **options)
    engine.joiner.policy = JoinPolicy(0)
    assert engine.choices.prefill_block == int(block)
    return engine, run_all(engine, jobs)


def test_blocked_prefill_gives_mlx_lm_s_greedy_tokens(tiny, monkeypatch) -> None:
    """Prompts of 1 to 300 tokens in blocks of 32, in chunks of 96 (so a chunk's blocks
    start past earlier chunks' keys), one with 2 seeded samples: each greedy token is
    mlx-lm's, and every token is the same as without blocks."""
    jobs = {f"p{n}": Request(prompt=_prompt(n), max_tokens=12) for n in (300, 1, 140, 33, 97)}
    jobs["p33"].n, jobs["p33"].temperature, jobs["p33"].seed = 2, 0.7, 5
    options = {"prefill_batch": 8, "prefill_step": 96}
    chunks = record_block_widths(monkeypatch)
    engine, blocked = _run(tiny, monkeypatch, "32", jobs, **options)
    assert max(chunks) == 96  # (chunks of 96 query rows reached the blocks)
    _, whole = _run(tiny, monkeypatch, "0", jobs, **options)
    for key, request in jobs.items():
        assert blocked[key].error is None, blocked[key].error
        assert blocked[key].token_ids == whole[key].token_ids, key
        if request.n == 1:
            want = reference(*tiny, engine.encode(request), request)["tokens"]
            assert blocked[key].token_ids == want, key
    samples = [c.token_ids for c in blocked["p33"].choices or []]
    assert samples == [c.token_ids for c in whole["p33"].choices or []] and len(samples) == 2


def test_blocked_prefill_after_a_stored_prefix(tiny, monkeypatch) -> None:
    """Suffixes of 70-150 tokens after a stored 160-token prefix, in blocks of 32: each
    block's keys start with the prefix's; mlx-lm's tokens."""
    shared = _prompt(160, salt=1)
    first = {f"f{n}": Request(prompt=[*shared, *_prompt(n)], max_tokens=4) for n in (6, 9)}
    jobs = {f"q{n}": Request(prompt=[*shared, *_prompt(n, 2)], max_tokens=8) for n in (70, 150)}
    monkeypatch.setenv(BLOCK_ENV, "32")
    monkeypatch.setenv(STREAMS_ENV, "1")
    engine = SlotEngine.from_loaded(*tiny, "tiny", max_batch=8, prefix_cache_bytes=1 << 24)
    engine.joiner.policy = JoinPolicy(0)
    run_all(engine, first, join_every=1)  # (one after the other: the second stores it)
    done = run_all(engine, jobs)
    assert engine.stats().prefix_hits >= len(jobs)
    for key, request in jobs.items():
        assert done[key].token_ids == reference(*tiny, request.prompt, request)["tokens"], key


def test_a_call_split_over_streams_attends_in_blocks_on_each_part(tiny, monkeypatch) -> None:
    """Two 200-token prompts in one group, split over two streams: each part attends in
    blocks on its own stream; mlx-lm's tokens."""
    streams: list[str] = []
    widths = record_block_widths(monkeypatch, streams)
    monkeypatch.setenv(BLOCK_ENV, "32")
    monkeypatch.setenv(STREAMS_ENV, "2")
    engine = SlotEngine.from_loaded(*tiny, "tiny", max_batch=8)
    engine.joiner.policy = JoinPolicy(0)
    pair = {f"p{n}": Request(prompt=_prompt(n), max_tokens=6) for n in (200, 190)}
    done = run_all(engine, pair)
    assert engine.stats().prefill_calls == 1
    layers = len(engine.model.layers)
    assert widths == [199] * 2 * layers  # (padded to the longer)
    assert len(set(streams)) == 2
    for key, request in pair.items():
        assert done[key].token_ids == reference(*tiny, request.prompt, request)["tokens"], key


def test_block_settings(monkeypatch) -> None:
    monkeypatch.delenv(BLOCK_ENV, raising=False)
    assert choose_block("cpu") == causal_blocks.CPU_BLOCK
    assert choose_block("cuda") == 0 and choose_block("metal") == 0
    monkeypatch.setenv(BLOCK_ENV, "0")
    assert choose_block("cpu") == 0
    monkeypatch.setenv(BLOCK_ENV, "64")
    assert choose_block("cuda") == 64
    for bad in ("-1", "big", "1.5"):
        monkeypatch.setenv(BLOCK_ENV, bad)
        with pytest.raises(ValueError, match=f"{BLOCK_ENV}={bad!r}: give a whole number"):
            choose_block("cpu")
