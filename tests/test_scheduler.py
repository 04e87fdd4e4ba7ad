"""Scheduling policy, without MLX: batch caps, memory budget, jobs too big to run."""

from mlxq.engine.scheduler import (
    Scheduler,
    admission_order,
    auto_max_batch,
    auto_prefill_batch,
    memory_budget,
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


def test_admits_against_the_memory_budget():
    s = make(budget=1000)
    assert s.try_admit("a", 300, 300)
    assert not s.try_admit("b", 300, 200)  # 600 + 500 > 1000
    assert s.try_admit("c", 200, 200)  # 600 + 400 fits
    assert s.reserved_bytes == 1000


def test_an_empty_batch_always_takes_a_job_that_fits_alone():
    s = make(budget=1000)
    assert s.try_admit("big", 600, 400)


def test_fits_alone_explains_context_and_memory_limits():
    s = make(budget=1000, ctx=512)
    assert "context length (512)" in s.fits_alone(500, 100)
    assert "lower max_tokens" in make(budget=100).fits_alone(50, 60)
    assert s.fits_alone(100, 100) is None


def test_fetch_count_prefetches_beyond_the_batch():
    s = make(max_batch=4)
    assert s.fetch_count(0) == 6 and s.fetch_count(6) == 0 and s.fetch_count(9) == 0


def test_auto_batch_from_memory():
    gib = 2**30
    budget = memory_budget(16 * gib, 2 * gib, 0.75)
    assert budget == 10 * gib
    # 128 KiB/token (8B-class with GQA, bf16) x 2048 tokens = 256 MiB/job -> 40 jobs
    assert auto_max_batch(budget, 128 * 1024) == 40
    assert auto_max_batch(budget, 1) == 256
    assert auto_max_batch(0, 128 * 1024) == 1


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
    assert s.prefill_batch([256] * 10) == 64
    assert s.prefill_batch([]) is None
    fixed = Scheduler(max_batch=64, kv_bytes_per_token=1, budget_bytes=10**9, context_length=4096)
    assert fixed.prefill_batch([256] * 10) is None
