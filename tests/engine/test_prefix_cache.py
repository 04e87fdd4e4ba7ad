"""Shared-prefix KV reuse: the block trie's bookkeeping, and the engine's output with it."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from engine_reference import FlakyModel, reference, run_all
from mlx_lm.models.cache import KVCache

from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine, Completion, EngineJob
from mlxq.engine.prefix_cache import DEFAULT_BLOCK, PrefixCache
from mlxq.wire import Request

# -- bookkeeping, no model: blocks of 4 tokens, payloads are labels of 100 bytes ----------


def small_cache(max_bytes: int = 10_000) -> PrefixCache:
    return PrefixCache(max_bytes, block_size=4, min_store_tokens=8)


def fill(cache: PrefixCache, plan: Any, nbytes: int = 100) -> None:
    cache.fill(plan, [(f"kv{i}", nbytes) for i in range(len(plan.store))])


def reused(cache: PrefixCache, prompt: list[int]) -> int:
    """Tokens of the prompt a job would take from the cache now."""
    plan = cache.plan(prompt)
    assert plan is not None, "the job would wait"
    return plan.reused_tokens


def produce(cache: PrefixCache, prompt: list[int]) -> None:
    """Count the prompt twice (a recurring prefix) and store it as its job would."""
    cache.observe(prompt)
    cache.observe(prompt)
    plan = cache.plan(prompt)
    assert plan is not None and plan.store
    fill(cache, plan)


SHARED = list(range(100, 112))  # three blocks


def test_a_prefix_seen_twice_is_stored_then_reused() -> None:
    cache = small_cache()
    a, b, c = [*SHARED, 1, 2], [*SHARED, 3, 4, 5, 6, 7], [*SHARED, 8]
    cache.observe(a)
    plan_a = cache.plan(a)  # seen once: nothing to reuse or store
    assert plan_a is not None and not plan_a.reused and not plan_a.store
    assert plan_a.segments(a) == [a]
    cache.observe(b)
    plan_b = cache.plan(b)  # the shared blocks are now seen twice: b stores them
    assert plan_b is not None and len(plan_b.store) == 3 and plan_b.store_to == 12
    assert plan_b.segments(b) == [SHARED, [3, 4, 5, 6, 7]]
    cache.observe(c)
    assert cache.plan(c) is None  # b is computing c's prefix: c waits for it
    fill(cache, plan_b)
    assert (cache.nbytes, cache.blocks, cache.stored_tokens) == (300, 3, 12)
    plan_c = cache.plan(c)  # the whole prompt but its last token comes from the cache
    assert plan_c is not None and plan_c.reused_tokens == 12 and not plan_c.store
    assert plan_c.segments(c) == [[8]]
    assert (cache.hits, cache.reused_tokens) == (1, 12)


def test_uncached_length_counts_what_follows_stored_or_pending_blocks() -> None:
    cache = small_cache()
    a, b = [*SHARED, 1, 2], [*SHARED, 3, 4, 5]
    assert cache.uncached_length(b) == len(b)  # nothing stored yet
    cache.observe(a)
    cache.plan(a)
    cache.observe(b)
    plan_b = cache.plan(b)  # b will store the shared blocks: they count as cached already
    assert cache.uncached_length([*SHARED, 9]) == 1
    fill(cache, plan_b)
    assert cache.uncached_length([*SHARED, 6, 7]) == 2
    assert cache.uncached_length([7, 7, 7]) == 3
    assert (cache.hits, cache.reused_tokens) == (0, 0)  # a look-up, not a use


def test_lookup_leaves_at_least_one_token_to_prefill() -> None:
    cache = small_cache()
    produce(cache, [*SHARED, 1])
    plan = cache.plan(SHARED)  # 12 tokens: 11 may come from the cache, so two blocks
    assert plan is not None and plan.reused_tokens == 8 and plan.segments(SHARED) == [SHARED[8:]]
    assert reused(cache, SHARED[:4]) == 0
    assert reused(cache, [100]) == 0  # shorter than a block
    other = [100, 101, 102, 7, *SHARED[4:], 1]  # differs in the first block
    assert reused(cache, other) == 0


def test_short_prefixes_are_not_stored() -> None:
    cache = small_cache()
    prompt = [*SHARED[:4], 1, 2, 3]  # one block of 4 tokens, under min_store_tokens (8)
    cache.observe(prompt)
    cache.observe(prompt)
    plan = cache.plan(prompt)
    assert plan is not None and not plan.store


def test_release_drops_pending_blocks() -> None:
    cache = small_cache()
    prompt = [*SHARED, 1]
    cache.observe(prompt)
    cache.observe(prompt)
    plan = cache.plan(prompt)
    assert plan is not None and plan.store
    assert cache.plan(prompt) is None
    plan.release()  # its job was cancelled before its prefix was stored
    again = cache.plan(prompt)
    assert again is not None and len(again.store) == 3  # the next job stores it instead
    assert cache.nbytes == 0 and cache.blocks == 0


def test_eviction_keeps_bytes_bounded_in_lru_order() -> None:
    cache = small_cache(max_bytes=400)  # four blocks of 100 bytes
    x, y, z = ([k] * 8 + [1] for k in (1, 2, 3))  # two blocks each, nothing shared
    produce(cache, x)
    produce(cache, y)
    assert reused(cache, x) == 8  # x is now newer
    produce(cache, z)  # 600 bytes: y, the least recently used, goes (leaf first)
    assert (cache.nbytes, cache.blocks, cache.evictions) == (400, 4, 2)
    assert reused(cache, y) == 0
    assert reused(cache, x) == 8
    assert reused(cache, z) == 8


def test_eviction_takes_leaves_and_keeps_shared_parents() -> None:
    cache = small_cache(max_bytes=500)
    a, b = SHARED + [1] * 4 + [9], SHARED + [2] * 4 + [9]  # 3 shared blocks + 1 own
    produce(cache, a)
    produce(cache, b)  # reuses the 3 shared blocks and stores its own: 500 bytes
    assert (cache.nbytes, cache.blocks) == (500, 5)
    produce(cache, [5] * 8 + [9])  # 700 bytes: a's own block and b's go, not the shared
    assert (cache.nbytes, cache.evictions) == (500, 2)
    assert reused(cache, a) == 12
    assert reused(cache, [*SHARED, 3]) == 12


def test_a_block_with_pending_children_is_not_evicted() -> None:
    cache = small_cache(max_bytes=500)
    produce(cache, [*SHARED, 1])  # 300 bytes
    longer = SHARED + [4] * 8 + [1]
    cache.observe(longer)
    cache.observe(longer)
    plan = cache.plan(longer)  # reuses the 3 blocks, stores 2 more below them
    assert plan is not None and plan.reused_tokens == 12 and len(plan.store) == 2
    produce(cache, [6] * 12 + [1])  # 600 bytes: only leaves may go, so one of these goes
    assert cache.nbytes == 500 and cache.evictions == 1
    assert cache.plan(longer) is None  # the shared blocks survived: still pending below
    assert reused(cache, [*SHARED, 1]) == 12
    fill(cache, plan)  # 700 bytes: the least recently used leaves go
    assert cache.nbytes == 500 and reused(cache, longer) == 20


def test_a_job_plans_to_store_only_what_fits() -> None:
    cache = PrefixCache(250, block_size=4, block_bytes=100, min_store_tokens=8)
    prompt = [*SHARED, 1]
    cache.observe(prompt)
    cache.observe(prompt)
    plan = cache.plan(prompt)  # three blocks would not fit: two do
    assert plan is not None and len(plan.store) == 2 and plan.store_to == 8
    fill(cache, plan, nbytes=120)  # bigger than estimated: the estimate follows
    assert cache.block_bytes == 120 and cache.nbytes == 240
    tiny = PrefixCache(150, block_size=4, block_bytes=100, min_store_tokens=8)
    tiny.observe(prompt)
    tiny.observe(prompt)
    plan = tiny.plan(prompt)  # the 8 tokens it may store (min_store_tokens) would not fit
    assert plan is not None and not plan.store


def random_layers() -> list[KVCache]:
    """Two layers' caches of 12 positions (2 heads of 8), random keys and values."""
    layers = []
    for _ in range(2):
        c = KVCache()
        c.keys, c.values = mx.random.normal((1, 2, 12, 8)), mx.random.normal((1, 2, 12, 8))
        c.offset = 12
        layers.append(c)
    return layers


def test_store_copies_blocks_and_kv_cache_joins_them() -> None:
    cache = PrefixCache(1 << 20, block_size=4, min_store_tokens=8)
    prompt = list(range(1, 15))  # 14 tokens: 3 blocks storable
    cache.observe(prompt)
    cache.observe(prompt)
    plan = cache.plan(prompt)
    assert plan is not None and plan.store_to == 12
    layers = random_layers()
    cache.store(plan, layers, [*prompt[:11], 0], prompt)  # not the prompt: not stored
    assert cache.blocks == 0 and not plan.store
    plan = cache.plan(prompt)
    assert plan is not None
    cache.store(plan, layers, prompt[:12], prompt)
    assert cache.nbytes == 2 * 2 * (2 * 12 * 8 * 4)  # layers x (keys, values), exactly
    hit = cache.plan([*prompt, 99])
    assert hit is not None and hit.reused_tokens == 12
    segments, kv, known = hit.start([*prompt, 99])
    assert segments == [[*prompt[12:], 99]] and known == prompt[:12]
    assert kv is not None and [c.offset for c in kv] == [12, 12]
    for got, want in zip(kv, layers, strict=True):
        assert mx.array_equal(got.keys, want.keys) and mx.array_equal(got.values, want.values)
        assert got.keys is not want.keys


def test_a_cut_plan_stores_its_blocks_where_they_are() -> None:
    """A job whose prefill group shares fewer stored blocks than it could reuse (its plan
    cut) prefills them again, and still stores its own new block from its place in the
    prompt: a later job reusing all three gets the keys and values of positions 0-11."""
    cache = PrefixCache(1 << 20, block_size=4, min_store_tokens=4)
    layers = random_layers()
    first = [*SHARED[:8], 1]
    for prompt in (first, [*SHARED[:8], 2]):
        cache.observe(prompt)
    plan = cache.plan(first)
    assert plan is not None and len(plan.store) == 2
    cache.store(plan, layers, first[:8], first)
    third, fourth = [*SHARED, 3], [*SHARED, 4]
    cache.observe(third)
    cache.observe(fourth)
    plan = cache.plan(third)
    assert plan is not None and plan.reused_tokens == 8 and plan.store_to == 12
    before = cache.reused_tokens
    plan.cut(1)
    assert plan.reused_tokens == 4 and cache.reused_tokens == before - 4
    cache.store(plan, layers, third[:12], third)
    hit = cache.plan(fourth)
    assert hit is not None and hit.reused_tokens == 12
    kv = cache.kv_cache(hit)
    assert kv is not None
    for got, want in zip(kv, layers, strict=True):
        assert mx.array_equal(got.keys, want.keys) and mx.array_equal(got.values, want.values)


# -- the engine with a prefix cache on the tiny model -------------------------------------

BLOCK = 16
RNG = random.Random(3)
PREFIX = [RNG.randrange(3, 512) for _ in range(20 * BLOCK)]  # 320 tokens
STORED = len(PREFIX) + BLOCK  # and the first block of s2's 17-token suffix, its repeat's too


def shared_jobs() -> dict[str, Request]:
    """Jobs sharing PREFIX: suffixes of 1 token (all but the last token cached), none
    (the prompt is the prefix), a few lengths, a repeat, a penalty, and a stranger."""
    rng = random.Random(4)
    jobs = {}
    for i, n in enumerate([1, 5, 17, 70, 130, 0, 1]):
        suffix = [rng.randrange(3, 512) for _ in range(n)]
        jobs[f"s{i}"] = Request(prompt=PREFIX + suffix, max_tokens=10 + i)
    jobs["repeat"] = Request(prompt=jobs["s2"].prompt, max_tokens=8)
    jobs["penalty"] = Request(prompt=[*PREFIX, 7, 8, 9], max_tokens=12, repetition_penalty=1.5)
    jobs["other"] = Request(prompt="The capital of France is", max_tokens=12)
    return jobs


def check_reference(
    tiny: Any, engine: BatchGeneratorEngine, jobs: dict[str, Request], done: dict[str, Completion]
) -> None:
    model, tokenizer = tiny
    for key, request in jobs.items():
        tokens = engine.encode(request)
        assert done[key].token_ids == reference(model, tokenizer, tokens, request)["tokens"], key
        assert done[key].prompt_tokens == len(tokens)


@pytest.mark.parametrize(
    ("max_batch", "prefill_batch", "prefill_step", "join_every"),
    [(32, 8, 2048, 0), (32, 8, 2048, 2), (4, 2, 48, 1), (3, 3, 100, 3)],
)
def test_greedy_with_reuse_equals_without_and_mlx_lm(
    tiny: Any, max_batch: int, prefill_batch: int, prefill_step: int, join_every: int
) -> None:
    model, tokenizer = tiny
    jobs = shared_jobs()
    sizes = {"max_batch": max_batch, "prefill_batch": prefill_batch, "prefill_step": prefill_step}
    plain = BatchGeneratorEngine.from_loaded(model, tokenizer, "tiny", **sizes)
    reuse = BatchGeneratorEngine.from_loaded(
        model, tokenizer, "tiny", prefix_cache_bytes=1 << 24, **sizes
    )
    without = run_all(plain, jobs, join_every)
    with_reuse = run_all(reuse, jobs, join_every)
    for key in jobs:
        assert with_reuse[key].token_ids == without[key].token_ids, key
        assert with_reuse[key].text == without[key].text
        assert with_reuse[key].finish_reason == without[key].finish_reason
    check_reference(tiny, reuse, jobs, with_reuse)
    stats = reuse.stats()
    assert stats.prefix_hits >= len(jobs) - 3 and stats.stored_tokens == STORED
    assert stats.prefilled_tokens < plain.stats().prefilled_tokens - 4 * len(PREFIX)
    assert reuse.active == 0


def test_a_burst_prefills_the_shared_prefix_once(tiny: Any) -> None:
    model, tokenizer = tiny
    jobs = shared_jobs()
    assert DEFAULT_BLOCK == BLOCK  # the figures below count the engine's blocks
    engine = BatchGeneratorEngine.from_loaded(model, tokenizer, "tiny", prefix_cache_bytes=1 << 24)
    done = run_all(engine, jobs)  # all admitted before the first step
    check_reference(tiny, engine, jobs, done)
    sharing = {k: r.prompt for k, r in jobs.items() if k not in ("other", "s0")}
    # s0 stores PREFIX's blocks and s2 one more (its repeat shares it): the others reuse
    # what of PREFIX fits before their last token, the repeat PREFIX and that block.
    reused = {k: min(len(PREFIX), (len(p) - 1) // BLOCK * BLOCK) for k, p in sharing.items()}
    reused["repeat"] += BLOCK
    stats = engine.stats()
    assert (stats.prefix_hits, stats.reused_tokens) == (len(sharing), sum(reused.values()))
    assert stats.stored_tokens == STORED and stats.prefix_evictions == 0
    assert stats.prefix_cache_bytes == STORED * engine.info.kv_bytes_per_token
    prompts = [len(engine.encode(r)) for r in jobs.values()]
    assert stats.prompt_tokens == sum(prompts)
    # mlx-lm feeds each prompt's last token to the first decode step, not the prefill.
    assert stats.prefilled_tokens == sum(prompts) - len(prompts) - sum(reused.values())
    assert stats.generated_tokens == sum(len(c.token_ids) for c in done.values())


def test_cancelled_producer_lets_waiting_jobs_run(tiny: Any) -> None:
    model, tokenizer = tiny
    engine = BatchGeneratorEngine.from_loaded(
        model, tokenizer, "tiny", prefill_step=16, prefix_cache_bytes=1 << 24
    )
    jobs = shared_jobs()
    for key in ("s0", "s1", "s2"):
        engine.add(EngineJob(key, jobs[key]))
    engine.step()  # s0 starts computing the prefix (16 tokens a step); s1 and s2 wait
    cancelled = engine.cancel("s0")
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    waiting = engine.cancel("s2")  # a job still waiting in the engine
    assert waiting is not None and waiting.finish_reason == "cancelled" and not waiting.token_ids
    done = run_all(engine, {"s3": jobs["s3"]})
    assert sorted(done) == ["s1", "s3"]
    check_reference(tiny, engine, {k: jobs[k] for k in done}, done)
    assert engine.stats().prefix_hits == 1  # s1 stored the prefix after s0 dropped it
    assert engine.cancel("s0") is None and engine.active == 0


def test_cache_bytes_stay_bounded(tiny: Any) -> None:
    model, tokenizer = tiny
    per_block = BLOCK * 512  # the tiny model's KV: 512 bytes a token
    engine = BatchGeneratorEngine.from_loaded(
        model, tokenizer, "tiny", prefix_cache_bytes=28 * per_block
    )
    rng = random.Random(5)
    jobs = {}
    for family in range(3):  # three prefixes of 20 blocks each: room for one and a bit
        prefix = [rng.randrange(3, 512) for _ in range(20 * BLOCK)]
        for i in range(3):
            jobs[f"{family}-{i}"] = Request(
                prompt=prefix + [rng.randrange(3, 512)] * (i + 1), max_tokens=6
            )
    done = run_all(engine, jobs, join_every=4)
    check_reference(tiny, engine, jobs, done)
    stats = engine.stats()
    assert stats.prefix_cache_bytes <= 28 * per_block and stats.prefix_evictions >= 32
    assert stats.stored_tokens == 3 * 20 * BLOCK and stats.prefix_hits >= 3


def test_model_error_with_prefix_cache_recovers(tiny: Any) -> None:
    model, tokenizer = tiny
    flaky = FlakyModel(model)
    engine = BatchGeneratorEngine.from_loaded(
        flaky,
        tokenizer,
        "tiny",
        max_batch=2,
        prefill_batch=1,
        prefill_step=64,
        prefix_cache_bytes=1 << 24,
    )
    jobs = shared_jobs()
    keys = ["s0", "s1", "s2", "s3"]
    for key in keys:
        engine.add(EngineJob(key, jobs[key]))
    engine.step()  # s0 is prefilling the prefix, the others wait for it
    flaky.fail = True
    failed = engine.step()
    flaky.fail = False
    assert [c.key for c in failed] == ["s0"] and failed[0].finish_reason == "error"
    done = run_all(engine, {})
    assert sorted(done) == keys[1:]
    check_reference(tiny, engine, {k: jobs[k] for k in keys[1:]}, done)
    assert engine.stats().prefix_hits == 2


def test_engine_loads_with_a_prefix_cache(tiny_model_dir: Any, tiny: Any) -> None:
    engine = BatchGeneratorEngine(str(tiny_model_dir), prefix_cache_bytes=1 << 20)
    jobs = {k: r for k, r in shared_jobs().items() if k in ("s0", "s1")}
    done = run_all(engine, jobs)
    check_reference(tiny, engine, jobs, done)
    assert engine.stats().prefix_hits == 1
    engine.close()
    assert engine.stats().prefix_cache_bytes == 0
