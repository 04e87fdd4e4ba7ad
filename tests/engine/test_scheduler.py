"""Scheduling policy, without MLX: batch caps, memory budget, jobs too big to run."""

from mlxq.engine.scheduler import (
    BATCH_CEILING,
    RECENT_JOBS,
    Scheduler,
    admission_order,
    auto_prefill_batch,
    cache_positions,
    cache_rows,
    choose_batch,
    grown_rows,
    memory_budget,
    rows_that_fit,
    slot_cache_bytes,
    split_budget,
)


def make(max_batch=4, budget=1000, kv=1, ctx=4096) -> Scheduler:
    return Scheduler(
        max_batch=max_batch,
        kv_bytes_per_token=kv,
        budget_bytes=budget,
        context_length=ctx,
        prefetch=2,
    )


def test_admits_up_to_the_batch_cap():
    s = make(max_batch=2, budget=10**9)
    assert s.try_admit("a", 10, 10) and s.try_admit("b", 10, 10)
    assert not s.try_admit("c", 10, 10)
    s.release("a")
    assert s.try_admit("c", 10, 10)


def test_admits_against_the_memory_budget_as_the_cache_holds_it():
    """The batch's cache is a rectangle: its rows (``cache_rows``) times the longest
    job's positions (whole steps of 256); the budget bounds that, not a sum of jobs."""
    s = make(max_batch=16, budget=4 * 768)
    assert s.try_admit("a", 300, 300)  # 1 row x 768
    assert s.reserved_bytes == 768
    assert s.try_admit("b", 10, 10)  # 2 rows x 768
    assert not s.try_admit("c", 500, 600)  # 4 rows x 1280 > 4 x 768
    assert s.try_admit("c", 100, 100) and s.reserved_bytes == 4 * 768
    assert s.try_admit("d", 10, 10)  # 4 rows still
    assert not s.try_admit("e", 10, 10)  # 8 rows x 768
    s.release("a")  # the longest left: 3 rows, now of 256
    assert s.reserved_bytes == 4 * 256
    assert s.try_admit("e", 10, 10) and s.try_admit("f", 10, 10) and s.active == 5
    assert s.reserved_bytes == 8 * 256


def test_cache_rows_double_then_grow_in_steps():
    assert [cache_rows(n) for n in (0, 1, 2, 3, 5, 8, 9, 17, 250)] == [
        0,
        1,
        2,
        4,
        8,
        8,
        16,
        24,
        256,
    ]
    assert cache_positions(1) == cache_positions(256) == 256 and cache_positions(257) == 512
    assert slot_cache_bytes(3, 300, 2) == 4 * 512 * 2
    # The first allocation holds every job admitted; later ones at most double, never
    # past those admitted, nor the engine's cap.
    assert grown_rows(1, 0, 1, 256) == 1 and grown_rows(8, 0, 100, 256) == 104
    assert grown_rows(9, 8, 100, 256) == 16 and grown_rows(9, 8, 9, 256) == 16
    assert grown_rows(40, 16, 40, 256) == 40 and grown_rows(3, 2, 3, 3) == 3


def test_an_empty_batch_always_takes_a_job_that_fits_alone():
    s = make(budget=1000)
    assert s.try_admit("big", 600, 400)


def test_fits_alone_explains_context_and_memory_limits():
    s = make(budget=1000, ctx=512)
    assert "context length (512)" in s.fits_alone(500, 100)
    assert "lower max_tokens" in make(budget=100).fits_alone(50, 60)
    assert s.fits_alone(100, 100) is None
    # n samples hold n rows: a job that fits alone once may not fit n times over
    one = make(budget=slot_cache_bytes(1, 200, 1))
    assert one.fits_alone(100, 100) is None
    assert "lower max_tokens or n" in one.fits_alone(100, 100, rows=4)


def test_fetch_count_prefetches_beyond_the_batch():
    s = make(max_batch=4, budget=10**6)
    assert s.fetch_count(0) == 6 and s.fetch_count(6) == 0 and s.fetch_count(9) == 0


def test_rows_that_fit_follow_the_slot_cache_rectangle():
    gib = 2**30
    budget = memory_budget(16 * gib, 2 * gib, 0.75)
    assert budget == 10 * gib
    # 128 KiB/token (8B-class with GQA, bf16) x 2048 tokens = 256 MiB/job -> 40 jobs
    assert rows_that_fit(budget, 2048, 128 * 1024) == 40
    assert slot_cache_bytes(40, 2048, 128 * 1024) <= budget < slot_cache_bytes(41, 2048, 128 * 1024)
    # Below ROW_STEP the cache holds a power of two rows; positions come in CACHE_STEPs.
    assert rows_that_fit(slot_cache_bytes(4, 300, 1) + 1, 300, 1) == 4
    assert rows_that_fit(slot_cache_bytes(4, 300, 1) - 1, 300, 1) == 2
    assert rows_that_fit(0, 2048, 128 * 1024) == 0


def test_fetch_count_plans_by_the_jobs_admitted_last():
    kv = 1024
    budget = slot_cache_bytes(64, 512, kv)  # 64 jobs of 512 tokens, 16 of 2,048
    s = make(max_batch=256, budget=budget, kv=kv, ctx=8192)
    # Before any job: planned at PLANNED_JOB_TOKENS.
    assert s.planned_rows() == 16 and s.fetch_count(0) == 16 + s.prefetch
    # Short jobs admitted: the pull plans by them.
    for i in range(8):
        assert s.try_admit(f"short{i}", 256, 256, 1)
    assert s.planned_rows() == 64
    # A long one admitted: planned by the longest of the recent jobs.
    for i in range(8):
        s.release(f"short{i}")
    assert s.try_admit("long", 1500, 500, 1)
    assert s.planned_rows() == 16
    s.release("long")
    # ... and once RECENT_JOBS short ones have followed it, by them again.
    for i in range(RECENT_JOBS):
        assert s.try_admit(f"later{i}", 256, 256, 1)
        s.release(f"later{i}")
    assert s.planned_rows() == 64
    # Never more than max_batch, never fewer than one.
    assert make(max_batch=4, budget=budget, kv=kv, ctx=8192).planned_rows() == 4
    assert make(max_batch=4, budget=1, kv=kv, ctx=8192).planned_rows() == 1


GIB = 2**30
KV_1B = 32 * 1024  # Llama-3.2-1B: 16 layers x 8 KV heads x 64 x (K, V) x bf16


def test_memory_decides_the_batch_only_where_it_holds_fewer_short_jobs_than_the_ceiling():
    # 8B-class on an H200: ~81 GiB of KV holds 320 jobs of 2,048 tokens but 2,592 of 256:
    # the ceiling decides, and admission goes by the jobs' real lengths (1,024 rows ran
    # 1.10x the 325 that planning every job at 2,048 tokens chose: bench/RESULTS.md).
    choice = choose_batch(81 * GIB, 128 * 1024, "cuda")
    assert (choice.size, choice.limit) == (1024, "backend ceiling")
    assert "holds 320 jobs of 2,048 tokens, 2,592 of 256" in choice.why
    assert "memory admits by the jobs' real lengths" in choice.why
    # Memory that holds fewer rows than the ceiling even of short jobs decides.
    small = choose_batch(4 * GIB, 128 * 1024, "cuda")
    assert (small.size, small.limit) == (128, "memory")
    assert small.why.startswith("batch up to 128: memory (a KV budget of 4.0 GiB holds 16")
    assert "below the cuda ceiling of 1,024" in small.why
    # Memory for less than one job still runs one at a time.
    assert choose_batch(GIB, 10 * GIB, "metal").size == 1
    # A model whose whole context is shorter than a cache step: jobs of its context.
    assert choose_batch(GIB, KV_1B, "cuda", context_length=128).size == 128


def test_the_backends_ceiling_caps_what_memory_would_hold():
    # 1B-class on an H200: ~93 GiB of KV holds 1,488 jobs: more rows than pay on CUDA.
    choice = choose_batch(93 * GIB, KV_1B, "cuda")
    assert (choice.size, choice.limit) == (BATCH_CEILING["cuda"], "backend ceiling")
    assert "the cuda ceiling, where more rows stop paying" in choice.why
    assert "holds 1,488 jobs of 2,048 tokens" in choice.why
    assert choose_batch(93 * GIB, KV_1B, "metal").size == BATCH_CEILING["metal"]
    assert choose_batch(93 * GIB, KV_1B, "cpu").size == BATCH_CEILING["cpu"]
    assert choose_batch(93 * GIB, KV_1B, "tpu").size == BATCH_CEILING["cpu"]  # unknown: cpu's
    # The ceilings: the widest measured gain on CUDA (bench/RESULTS.md); each wider than
    # the CPU's.
    assert BATCH_CEILING["cuda"] >= 1024 > 256
    assert BATCH_CEILING["cpu"] < BATCH_CEILING["metal"] < BATCH_CEILING["cuda"]


def test_max_batch_given_decides_above_or_below_both():
    above = choose_batch(93 * GIB, KV_1B, "cuda", given=4096)
    assert (above.size, above.limit) == (4096, "--max-batch")
    assert "set by --max-batch" in above.why and "admission waits for room" in above.why
    below = choose_batch(GIB, 128 * 1024, "cpu", given=3)
    assert (below.size, below.limit) == (3, "--max-batch")
    assert "waits" not in below.why and "the cpu ceiling is" in below.why


def test_admission_order_is_shortest_first_and_stable():
    assert admission_order([300, 12, 12, 5000, 40]) == [1, 2, 4, 0, 3]
    assert admission_order([]) == []


def test_prefix_cache_share_comes_out_of_the_kv_budget():
    assert split_budget(1000, 0.1) == (900, 100)
    assert split_budget(1000, 0.0) == (1000, 0)


def test_auto_prefill_batch_targets_a_token_budget():
    assert auto_prefill_batch([128] * 256, cap=256, prefill_step=2048) == 128  # 16384 / 128
    assert auto_prefill_batch([1000] * 10, cap=256, prefill_step=2048) == 16
    assert auto_prefill_batch([128] * 256, cap=32, prefill_step=2048) == 32  # the batch caps it
    assert auto_prefill_batch([50_000], cap=256, prefill_step=2048) == 8  # chunks of 2048
    long_tail = [16] * 80 + [1024] * 20  # the 90th percentile, not the median, decides
    assert auto_prefill_batch(long_tail, cap=256, prefill_step=2048) == 16
    assert auto_prefill_batch([], cap=256, prefill_step=2048) == 8


def test_scheduler_sizes_prefill_only_when_automatic():
    s = Scheduler(
        max_batch=64,
        kv_bytes_per_token=1,
        budget_bytes=10**9,
        context_length=4096,
        auto_prefill=True,
    )
    assert s.fetch_count(64) == 8  # the batch held: its prefetch beyond
    assert s.prefill_batch([256] * 10) == 64
    # A prefill call's worth waits beyond the batch: a wave ending together refills at once.
    assert s.fetch_count(64) == 64 and s.fetch_count(128) == 0
    assert s.prefill_batch([]) is None
    fixed = Scheduler(max_batch=64, kv_bytes_per_token=1, budget_bytes=10**9, context_length=4096)
    assert fixed.prefill_batch([256] * 10) is None
