"""The slot engine: the same contract as the BatchGenerator engine, checked against mlx-lm.

The engine-only tests of test_engine.py run here again on a slot engine (their ``engine``
fixture is this module's); the rest are the slot engine's own: joins and finishes
mid-batch, prefill buckets, attention groups and sorting, prefix reuse, batch hooks,
attention kernels. The compiled forward: test_slot_compiled.py; model families and
quantized caches: test_slot_models.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
import test_engine as base
from engine_reference import REQUESTS, FlakyModel, check_against_reference, reference, run_all
from mlx_lm.utils import load_tokenizer

from mlxq.engine.factory import make_engine
from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine
from mlxq.engine.protocol import BatchEngine
from mlxq.engine.sampling import EngineJob
from mlxq.engine.slots import choices as slot_choices
from mlxq.engine.slots import engine as slot_engine
from mlxq.engine.slots import order as slot_order
from mlxq.engine.slots import step as slot_step
from mlxq.engine.slots.attention import KERNELS, choose_kernel, fused_decode, gqa_decode
from mlxq.engine.slots.engine import SlotEngine
from mlxq.engine.slots.joins import JoinPolicy
from mlxq.engine.slots.order import sorted_order, span_groups
from mlxq.wire import Request


@pytest.fixture
def engine(tiny) -> SlotEngine:
    model, tokenizer = tiny
    return SlotEngine.from_loaded(model, tokenizer, "tiny")


# test_engine's tests that use only the ``engine`` fixture, on the slot engine.
test_batched_greedy_equals_single_requests = base.test_batched_greedy_equals_single_requests
test_model_info = base.test_model_info
test_encode = base.test_encode
test_max_tokens_gives_length = base.test_max_tokens_gives_length
test_logprobs = base.test_logprobs
test_repetition_penalty_matches_mlx_lm = base.test_repetition_penalty_matches_mlx_lm
test_bad_requests_fail_alone = base.test_bad_requests_fail_alone
test_duplicate_key_is_refused = base.test_duplicate_key_is_refused
test_timing_fields = base.test_timing_fields
test_warmup_leaves_nothing_behind = base.test_warmup_leaves_nothing_behind
test_stats_count_prompt_and_generated_tokens = base.test_stats_count_prompt_and_generated_tokens


@pytest.mark.parametrize(
    ("max_batch", "prefill_batch", "prefill_step", "join_every"),
    [(32, 8, 2048, 3), (4, 2, 7, 2), (2, 1, 16, 1), (3, 3, 5, 0)],
)
def test_jobs_joining_mid_run_equal_single_requests(
    tiny, max_batch: int, prefill_batch: int, prefill_step: int, join_every: int
) -> None:
    model, tokenizer = tiny
    sizes = {"max_batch": max_batch, "prefill_batch": prefill_batch, "prefill_step": prefill_step}
    # Joins in groups held back by idle slots (as on a GPU), or at once.
    policies = (("gqa", JoinPolicy(wait=4, idle_budget=6, max_wait=5)), ("fused", JoinPolicy(0)))
    for attention, policy in policies:
        engine = SlotEngine.from_loaded(model, tokenizer, "tiny", attention=attention, **sizes)
        engine.joiner.policy = policy
        done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, join_every)
        check_against_reference(tiny, engine, done)
        assert engine.batch.cache.free_slots == max_batch  # every slot given back


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_overlapped_steps_equal_single_requests(
    tiny, monkeypatch: pytest.MonkeyPatch, overlap: str
) -> None:
    """Steps built while the last one runs (the CUDA default) give the same tokens."""
    model, tokenizer = tiny
    monkeypatch.setenv("MLXQ_SLOT_OVERLAP", overlap)
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=4, prefill_batch=2)
    assert engine.choices.overlap is (overlap == "1")
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, 2)
    check_against_reference(tiny, engine, done)
    assert engine.batch.cache.free_slots == 4


@pytest.mark.parametrize("prefill_step", [2048, 7])
def test_bucketed_prefill_shapes_equal_single_requests(
    tiny, monkeypatch: pytest.MonkeyPatch, prefill_step: int
) -> None:
    """Prefill calls padded to bucket shapes (dummy rows, longer chunks), with the other
    CUDA defaults (compiled forward, overlapped steps), give the same tokens, with and
    without a cached prefix."""
    model, tokenizer = tiny
    for env in (slot_choices.BUCKETS_ENV, slot_choices.COMPILE_ENV, slot_choices.OVERLAP_ENV):
        monkeypatch.setenv(env, "1")
    sizes = {"max_batch": 5, "prefill_batch": 3, "prefill_step": prefill_step}
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", **sizes)
    assert engine.choices.prefill_buckets and engine.choices.compiled and engine.choices.overlap
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, 2)
    check_against_reference(tiny, engine, done)
    shared = list(range(3, 200))
    jobs = {f"j{i}": Request(prompt=[*shared, 300 + i, 301 + i], max_tokens=8) for i in range(5)}
    cached = SlotEngine.from_loaded(model, tokenizer, "t", prefix_cache_bytes=1 << 24, **sizes)
    reused = run_all(cached, dict(jobs), join_every=2)
    assert cached.stats().prefix_hits >= 3
    for key, request in jobs.items():
        want = reference(model, tokenizer, cached.encode(request), request)["tokens"]
        assert reused[key].token_ids == want


def test_bucketed_groups_take_whole_buckets_of_jobs(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """37 waiting jobs with bucketed prefill: 32 join first (no dummy rows), then the 5."""
    model, tokenizer = tiny
    monkeypatch.setenv(slot_choices.BUCKETS_ENV, "1")
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=40, prefill_batch=40)
    jobs = {f"j{i}": Request(prompt=[3 + i, 40 + i, 90 + 2 * i], max_tokens=4) for i in range(37)}
    done = run_all(engine, jobs)
    assert engine.stats().prefill_calls == 2
    for key, request in jobs.items():
        want = reference(model, tokenizer, engine.encode(request), request)["tokens"]
        assert done[key].token_ids == want, key


def test_span_groups_split_only_where_it_saves() -> None:
    lengths = [10] * 4 + [200] * 4 + [205] * 4
    # Always split: each run of four attends up to its own longest row (rounded to 32).
    assert span_groups(lengths, 4, 0) == [(0, 4, 32), (4, 8, 224), (8, 12, 224)]
    # The last two runs share a span: merging them costs nothing, so they merge.
    assert span_groups(lengths, 4, 1) == [(0, 4, 32), (4, 12, 224)]
    # Splitting off the short rows saves 4 x 192 row-positions: kept only below that.
    assert span_groups(lengths, 4, 768) == [(0, 4, 32), (4, 12, 224)]
    assert span_groups(lengths, 4, 769) == [(0, 12, 224)]


def test_groups_of_slots_equal_single_requests(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows attending in groups of two, each over its own span, give the same tokens."""
    model, tokenizer = tiny
    monkeypatch.setattr(slot_step, "GROUP_ROWS", 2)
    monkeypatch.setenv(slot_choices.SPLIT_ENV, "0")
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=8, prefill_batch=2)
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, 1)
    check_against_reference(tiny, engine, done)


def test_sorted_order_only_when_it_pays() -> None:
    # Four groups of two: long and short rows alternate, so every group spans 224.
    mixed = {0: 200, 1: 10, 2: 201, 3: 11, 4: 202, 5: 12, 6: 203, 7: 13}
    assert sorted_order(mixed, 2, 0) == [1, 3, 5, 7, 0, 2, 4, 6]
    packed = {0: 10, 1: 11, 2: 200, 3: 201}
    assert sorted_order(packed, 2, 0) is None  # already in order
    assert sorted_order({0: 5, 1: 300}, 2, 0) is None  # one group either way


def test_rows_sorted_mid_run_equal_single_requests(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows moved into length order between steps (here whenever it does not read more)
    keep their tokens: the cache, the bookkeeping and a step in flight follow them."""
    model, tokenizer = tiny
    monkeypatch.setattr(slot_step, "GROUP_ROWS", 2)
    monkeypatch.setenv(slot_choices.SPLIT_ENV, "0")
    monkeypatch.setattr(slot_engine, "SORT_EVERY", 1)
    monkeypatch.setattr(slot_order, "SORT_GAIN", 0.999)
    for overlap in ("1", "0"):
        monkeypatch.setenv("MLXQ_SLOT_OVERLAP", overlap)
        engine = SlotEngine.from_loaded(model, tokenizer, "tiny", max_batch=6, prefill_batch=1)
        done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, 1)
        check_against_reference(tiny, engine, done)
        assert engine.stats().sorts > 0 and engine.batch.cache.free_slots == 6


def test_engines_satisfy_the_protocol(tiny) -> None:
    import sys

    from helpers import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from queue_overhead import StubEngine
    finally:
        sys.path.remove(str(ROOT / "bench"))
    model, tokenizer = tiny
    engines = [
        SlotEngine.from_loaded(model, tokenizer, "t"),
        BatchGeneratorEngine.from_loaded(model, tokenizer, "t"),
    ]
    for engine in [*engines, StubEngine(0.0)]:
        assert isinstance(engine, BatchEngine), type(engine).__name__


def test_seeded_sampling_is_reproducible_across_batches(tiny) -> None:
    model, tokenizer = tiny

    def sampled(seed: int, **kw: Any) -> Request:
        return Request(prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed, **kw)

    alone = run_all(SlotEngine.from_loaded(model, tokenizer, "t"), {"s": sampled(7)})["s"]
    crowd = {
        "g": Request(prompt="The capital of France is", max_tokens=20),
        "x": sampled(8),
        "s": sampled(7),
        "y": sampled(7, top_p=0.9, top_k=50, min_p=0.05),
    }
    engine = SlotEngine.from_loaded(model, tokenizer, "t", max_batch=3, prefill_step=3)
    mixed = run_all(engine, crowd, join_every=2)
    assert mixed["s"].token_ids == alone.token_ids
    assert mixed["x"].token_ids != alone.token_ids
    greedy = reference(model, tokenizer, tokenizer.encode("Once upon a time"), sampled(7))
    assert alone.token_ids != greedy["tokens"]


def test_stop_strings_and_eos(tiny, tiny_model_dir: Path) -> None:
    model, tokenizer = tiny
    request = Request(prompt="The capital of France is", max_tokens=20)
    ref = reference(model, tokenizer, tokenizer.encode(request.prompt), request)
    text = ref["text"]
    stop = text[9:12]
    engine = SlotEngine.from_loaded(model, tokenizer, "tiny")
    done = run_all(engine, {"one": Request(prompt=request.prompt, max_tokens=20, stop=[stop])})
    assert done["one"].finish_reason == "stop" and done["one"].text == text[: text.find(stop)]
    assert engine.stats().generated_tokens == len(done["one"].token_ids)  # left at once
    eos = ref["tokens"][5]
    eos_engine = SlotEngine.from_loaded(
        model, load_tokenizer(tiny_model_dir, eos_token_ids=[eos]), "t"
    )
    out = run_all(eos_engine, {"a": request})["a"]
    assert (
        out.finish_reason == "stop" and out.token_ids == ref["tokens"][: ref["tokens"].index(eos)]
    )


def test_cancel_and_streaming(tiny, engine: SlotEngine) -> None:
    model, tokenizer = tiny
    engine.add(EngineJob("a", REQUESTS[0]))
    streamed = Request(prompt=[5, 6, 7], max_tokens=24, stream=True)
    engine.add(EngineJob("b", streamed))
    for _ in range(5):
        engine.step()
    engine.add(EngineJob("waiting", Request(prompt=[1, 2, 3])))
    cancelled = engine.cancel("a")
    ref_a = reference(model, tokenizer, engine.encode(REQUESTS[0]), REQUESTS[0])["tokens"]
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    assert 0 < len(cancelled.token_ids) < len(ref_a)
    assert cancelled.token_ids == ref_a[: len(cancelled.token_ids)]
    waiting = engine.cancel("waiting")
    assert waiting is not None and waiting.token_ids == [] and engine.cancel("a") is None
    done = run_all(engine, {})
    ref_b = reference(model, tokenizer, [5, 6, 7], streamed)["tokens"]
    assert done["b"].token_ids == ref_b
    chunks = [c for c in engine.take_stream() if c.key == "b"]
    assert [t for c in chunks for t in c.token_ids] == ref_b
    assert "".join(c.text for c in chunks) == done["b"].text


def test_model_error_fails_the_batch_and_engine_recovers(tiny) -> None:
    model, tokenizer = tiny
    flaky = FlakyModel(model)
    engine = SlotEngine.from_loaded(flaky, tokenizer, "tiny", max_batch=2, prefill_batch=2)
    for i in range(3):
        engine.add(EngineJob(str(i), REQUESTS[i]))
    engine.step()
    flaky.fail = True
    failed = engine.step()
    flaky.fail = False
    assert sorted(c.key for c in failed) == ["0", "1"]
    assert all(c.finish_reason == "error" and "out of memory" in c.error for c in failed)
    assert engine.active == 1  # the job waiting for a slot was kept
    done = run_all(engine, {"3": REQUESTS[3]})
    for key in ("2", "3"):
        request = REQUESTS[int(key)]
        assert (
            done[key].token_ids
            == reference(model, tokenizer, engine.encode(request), request)["tokens"]
        )


def test_a_lost_peer_rank_is_raised_not_a_failure_of_the_jobs(tiny) -> None:
    """A collective whose peer rank died (tensor parallel) fails no job, neither in a
    decode step nor in a joining group's prefill: it is raised, and the worker puts the
    jobs back (CI caught a group of 4 failed when the rank died inside its prefill)."""
    model, tokenizer = tiny
    flaky = FlakyModel(model)
    flaky.error = "[ring] connection to a peer was lost"
    engine = SlotEngine.from_loaded(flaky, tokenizer, "tiny", max_batch=4, prefill_batch=2)
    engine.joiner.policy = JoinPolicy(0)
    for i in range(2):
        engine.add(EngineJob(str(i), REQUESTS[i]))
    engine.step()
    flaky.fail = True
    with pytest.raises(RuntimeError, match="peer was lost"):  # (a decode step)
        for _ in range(4):
            engine.step()
    flaky.fail = False
    engine = SlotEngine.from_loaded(flaky, tokenizer, "tiny", max_batch=4, prefill_batch=2)
    engine.add(EngineJob("a", REQUESTS[0]))
    flaky.fail = True
    with pytest.raises(RuntimeError, match="peer was lost"):  # (the join's prefill)
        engine.step()


def test_prefix_reuse_writes_the_prefix_into_slots(tiny) -> None:
    model, tokenizer = tiny
    shared = list(range(3, 200))
    jobs = {f"j{i}": Request(prompt=[*shared, 300 + i, 301 + i], max_tokens=8) for i in range(6)}
    plain = run_all(SlotEngine.from_loaded(model, tokenizer, "t", max_batch=4), dict(jobs), 2)
    engine = SlotEngine.from_loaded(model, tokenizer, "t", max_batch=4, prefix_cache_bytes=1 << 24)
    reused = run_all(engine, dict(jobs), join_every=2)
    assert {k: c.token_ids for k, c in reused.items()} == {k: c.token_ids for k, c in plain.items()}
    stats = engine.stats()
    assert stats.prefix_hits >= 4 and stats.reused_tokens >= 4 * 192
    assert stats.prefilled_tokens < sum(len(r.prompt) for r in jobs.values()) - 4 * 192


def test_prompts_sharing_a_short_system_prompt_prefill_together(tiny) -> None:
    """A chat burst: every prompt starts with a one-block system prompt, and pairs also
    share their question's first block. The first job stores the system block (and its
    pair's); the others reuse it, prefilling in groups from the block they all share
    even where a pair's own block is stored too: 3 prefill calls (a group per stored
    prefix would take 6). Tokens equal mlx-lm's and a run without the cache."""
    model, tokenizer = tiny
    system = list(range(3, 19))
    questions = [[100 + 20 * q + i for i in range(16)] for q in range(4)]
    jobs = {
        f"j{i}": Request(prompt=[*system, *questions[i // 2], 400 + i, 5, 6, 7, 8], max_tokens=6)
        for i in range(8)
    }
    plain = run_all(SlotEngine.from_loaded(model, tokenizer, "t", max_batch=8), dict(jobs))
    engine = SlotEngine.from_loaded(model, tokenizer, "t", max_batch=8, prefix_cache_bytes=1 << 24)
    reused = run_all(engine, dict(jobs))
    assert {k: c.token_ids for k, c in reused.items()} == {k: c.token_ids for k, c in plain.items()}
    for key, request in jobs.items():
        want = reference(model, tokenizer, engine.encode(request), request)["tokens"]
        assert reused[key].token_ids == want, key
    stats = engine.stats()
    assert stats.prefill_calls == 3
    assert (stats.prefix_hits, stats.reused_tokens, stats.stored_tokens) == (7, 7 * 16, 5 * 16)
    assert stats.prefilled_tokens == 20 * 8 + 16


class BanToken:
    """A batch hook that forbids one token in every row and records what it saw."""

    def __init__(self, token: int) -> None:
        self.token, self.admitted, self.accepted, self.released = token, [], [], []

    def admit(self, key: str, request: Request) -> None:
        self.admitted.append(key)

    def process(self, logits: mx.array, rows: list[str]) -> mx.array:
        assert logits.shape[0] == len(rows)
        ban = mx.arange(logits.shape[-1]) == self.token
        return mx.where(ban, -mx.inf, logits)

    def accept(self, rows: list[str], tokens: list[int]) -> None:
        self.accepted.extend(zip(rows, tokens, strict=True))

    def release(self, key: str) -> None:
        self.released.append(key)


def test_batch_hooks_see_every_row(tiny) -> None:
    model, tokenizer = tiny
    free = run_all(SlotEngine.from_loaded(model, tokenizer, "t"), {"a": REQUESTS[0]})["a"]
    hook = BanToken(free.token_ids[2])
    engine = SlotEngine.from_loaded(model, tokenizer, "t", hooks=[hook])
    done = run_all(engine, {"a": REQUESTS[0], "b": REQUESTS[2]})
    assert hook.token not in done["a"].token_ids
    assert done["a"].token_ids[:2] == free.token_ids[:2] and done["a"].token_ids != free.token_ids
    assert sorted(hook.admitted) == sorted(hook.released) == ["a", "b"]
    assert [t for k, t in hook.accepted if k == "b"] == done["b"].token_ids


def test_decode_kernels_agree_and_free_rows_stay_finite() -> None:
    rows, q_heads, kv_heads, span, dim = 5, 8, 2, 64, 16
    keys = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((rows, q_heads, 1, dim), key=keys[0])
    k = mx.random.normal((rows, kv_heads, span, dim), key=keys[1])
    v = mx.random.normal((rows, kv_heads, span, dim), key=keys[2])
    lengths = mx.array([1, 10, 33, 64, 0])  # the last row is a free slot: nothing valid
    mask = (mx.arange(span)[None] < lengths[:, None])[:, None, None, :]
    own = gqa_decode(q, k, v, dim**-0.5, mask)
    assert not mx.isnan(own).any().item()
    fused = fused_decode(q[:4], k[:4], v[:4], dim**-0.5, mask[:4])
    assert mx.allclose(own[:4], fused, atol=1e-5).item()
    compiled = KERNELS["gqa-compiled"](q, k, v, dim**-0.5, mask)
    assert mx.allclose(compiled, own, atol=1e-6).item()
    # In bfloat16 (the scores in the model's dtype, the softmax accumulated in float32).
    q16, k16, v16 = (a.astype(mx.bfloat16) for a in (q, k, v))
    own16 = gqa_decode(q16, k16, v16, dim**-0.5, mask)
    assert own16.dtype == mx.bfloat16 and not mx.isnan(own16).any().item()
    fused16 = fused_decode(q16[:4], k16[:4], v16[:4], dim**-0.5, mask[:4])
    assert mx.allclose(own16[:4], fused16, atol=2e-2).item()
    cuda = "ragged" if mx.cuda.is_available() else "gqa"  # (its kernel needs a GPU)
    assert choose_kernel("cuda")[0] == cuda and choose_kernel("metal")[0] == "fused"
    assert choose_kernel("cuda", head_dim=48)[0] == "gqa"  # (heads it cannot run)
    assert choose_kernel("cpu")[0] == "gqa"
    with pytest.raises(ValueError, match="gqa"):
        choose_kernel("cpu", "flash")
    with pytest.raises(ValueError, match="needs CUDA and heads of a multiple of 64"):
        choose_kernel("cpu", "ragged")


@pytest.mark.parametrize("compiled", ["0", "1"])
def test_lora_adapter_equals_mlx_lm(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: str
) -> None:
    """With the eager and the compiled decode forward (the CUDA default)."""
    from test_lora import JOBS, make_adapter

    monkeypatch.setenv(slot_choices.COMPILE_ENV, compiled)
    adapter = make_adapter(tiny_model_dir, tmp_path / "lora")
    model, tokenizer = mlx_lm.load(str(tiny_model_dir), adapter_path=str(adapter))
    engine = make_engine(model, tokenizer, "lora", max_batch=2, prefill_batch=2)
    assert type(engine) is SlotEngine and engine.choices.compiled is (compiled == "1")
    done = run_all(engine, dict(JOBS), join_every=1)
    for key, request in JOBS.items():
        expected = reference(model, tokenizer, engine.encode(request), request)["tokens"]
        assert done[key].token_ids == expected, key


def test_a_pipeline_stage_never_clears_mlx_s_cache(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mx.clear_cache`` waits for every stream holding the GIL: on a stage whose relay
    holds a send to a rank that is gone it hangs the whole process. A plain engine gives
    MLX's buffers back once idle; a stage keeps them."""
    model, tokenizer = tiny
    cleared: list[int] = []
    monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1))
    for stage in (False, True):
        engine = SlotEngine.from_loaded(model, tokenizer, "tiny")
        if stage:
            engine.as_stage(True)
        cleared.clear()
        done = run_all(engine, {"a": Request(prompt=[5, 6, 7], max_tokens=4)})
        assert done["a"].finish_reason == "length"
        assert bool(cleared) is not stage
