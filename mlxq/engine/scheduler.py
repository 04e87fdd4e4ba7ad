"""Scheduling policy: how many jobs to pull and admit, as plain Python (no MLX).

The KV cache of a running job grows to (prompt + max_tokens) tokens, each costing
``kv_bytes_per_token``. The batch's cache is one rectangle: a row per job, every row as
long as the longest (the slot cache, :mod:`mlxq.engine.slots.cache`, holds at most
:func:`cache_rows` rows for the jobs admitted, in positions rounded up to
:data:`CACHE_STEP`; mlx-lm's batch cache pads to the longest too). The scheduler admits
a job only while that rectangle at the admitted jobs' worst case,
:func:`slot_cache_bytes`, fits the memory budget: the budget is the one bound on the
cache's allocation, and a batch of long prompts waits for room instead of exhausting
memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# The automatic batch's ceiling by backend: the rows past which a wider decode batch stops
# paying (each step slower for little more throughput; on an H200 a 1B step is
# compute-bound past ~600 rows). Memory may set it lower; --max-batch sets it outright.
# CUDA's and the CPU's are measured (batch sweeps, bench/RESULTS.md); Metal's, one doubling
# past 256, is an estimate: an Apple GPU turns compute-bound at fewer rows.
BATCH_CEILING = {"cpu": 128, "metal": 512, "cuda": 1024}
# The slot engine's rows when the automatic batch is narrower: its join pacing (a share of
# its rows) stays as it was tuned.
ENGINE_ROWS = 256
# The job length a worker plans its pulls for before it has admitted any (prompt + output
# tokens); then it plans by the longest of the last RECENT_JOBS it admitted.
PLANNED_JOB_TOKENS = 2048
RECENT_JOBS = 64
# Prompt tokens one prefill call may process when the prefill batch is automatic. On a
# GPU, wide calls keep it busy (an H200 ran a 1B model 2.5x faster at 128 x 128 prompt
# tokens per call than at mlx-lm's default of 8 prompts); a CPU is compute-bound, so the
# padding of wide calls costs more than it saves.
PREFILL_TOKENS = {"cpu": 2048, "metal": 16384, "cuda": 16384}
# Prompts prefilled together before any are waiting (mlx-lm's own default).
DEFAULT_PREFILL_BATCH = 8


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The slot cache's rows grow in steps of this many positions (a copy of the cache each).
CACHE_STEP = 256
# Beyond this many, the slot cache's rows come in multiples of it.
ROW_STEP = 8


def cache_positions(tokens: int, step: int = CACHE_STEP) -> int:
    """Positions a cache row holds to fit ``tokens``: whole steps."""
    return -(-max(tokens, 1) // step) * step


def cache_rows(jobs: int) -> int:
    """Rows the slot cache holds for ``jobs`` jobs: a power of two up to
    :data:`ROW_STEP` (a lone job, one row), then whole steps (a copy every few joins
    when jobs trickle in, and few shapes for a compiled forward to trace)."""
    if jobs <= ROW_STEP:
        return 1 << (jobs - 1).bit_length() if jobs > 0 else 0
    return -(-jobs // ROW_STEP) * ROW_STEP


def slot_cache_bytes(jobs: int, tokens: int, kv_bytes_per_token: int) -> int:
    """Bytes of the slot cache of ``jobs`` jobs, the longest ``tokens`` long."""
    return cache_rows(jobs) * cache_positions(tokens) * kv_bytes_per_token


def grown_rows(needed: int, rows: int, admitted: int, cap: int) -> int:
    """Rows a cache of ``rows`` grows to when it must hold ``needed``: all ``admitted``
    jobs at its first allocation, then up to twice as many (copies amortized), never
    more than :func:`cache_rows` of those admitted (nor ``cap``)."""
    return min(cap, cache_rows(max(needed, min(admitted, 2 * rows) if rows else admitted)))


def kv_group_size(head_dim: int) -> int | None:
    """The quantization group of a KV cache with heads of ``head_dim`` values: 64, else
    32, else None (too narrow to quantize)."""
    return next((g for g in (64, 32) if head_dim % g == 0), None)


def quantized_kv_bytes(kv_bytes_per_token: int, dtype: str, head_dim: int, bits: int) -> int:
    """A token's KV bytes when the cache holds ``bits``-bit values: packed values plus a
    scale and a bias of the model's dtype per group."""
    size = _DTYPE_BYTES.get(dtype, 2)
    group = kv_group_size(head_dim) or head_dim
    values = kv_bytes_per_token // size
    return values * bits // 8 + values // group * 2 * size


def memory_budget(total_bytes: int, model_bytes: int, fraction: float = 0.75) -> int:
    """Bytes left for KV caches: a fraction of device memory minus the weights."""
    return max(0, int(total_bytes * fraction) - model_bytes)


def admission_order(prompt_lengths: list[int]) -> list[int]:
    """The order to admit one pull's jobs in (indices): shortest prompt first, ties in
    arrival order. Prefill batches pad to their longest prompt, so neighbours of similar
    length waste less compute; across pulls, arrival order still holds."""
    return sorted(range(len(prompt_lengths)), key=lambda i: (prompt_lengths[i], i))


def auto_prefill_batch(
    prompt_lengths: list[int], cap: int, prefill_step: int, tokens: int = PREFILL_TOKENS["cuda"]
) -> int:
    """Prompts to prefill together so one call processes about ``tokens`` prompt tokens.

    Sized on the 90th-percentile waiting prompt, so a long tail cannot make one call
    (padded to its longest prompt) huge; a chunk is at most ``prefill_step`` tokens long.
    At least 1 and at most ``cap`` (the batch size).
    """
    if not prompt_lengths:
        return max(1, min(cap, DEFAULT_PREFILL_BATCH))
    ranked = sorted(prompt_lengths)
    typical = min(ranked[min(len(ranked) - 1, len(ranked) * 9 // 10)], prefill_step)
    return max(1, min(cap, tokens // max(1, typical)))


def split_budget(budget_bytes: int, prefix_fraction: float) -> tuple[int, int]:
    """(bytes for running jobs' KV, bytes for the shared-prefix cache) of a KV budget."""
    prefix = int(budget_bytes * prefix_fraction)
    return budget_bytes - prefix, prefix


@dataclass(frozen=True)
class BatchChoice:
    """The batch size a worker admits and which limit decided it."""

    size: int
    limit: str  # "memory", "backend ceiling" or "--max-batch"
    why: str  # one line: the size, the limit, and the figures behind it


def choose_batch(
    budget_bytes: int,
    kv_bytes_per_token: int,
    backend: str,
    given: int | None = None,
    context_length: int = PLANNED_JOB_TOKENS,
) -> BatchChoice:
    """The batch size: ``given`` (--max-batch), else the backend's ceiling
    (:data:`BATCH_CEILING`), lower only where the KV budget holds fewer rows even of the
    shortest jobs (:data:`CACHE_STEP` tokens, or the whole context if shorter).

    Memory is not planned at one job length here: the scheduler admits by the real jobs'
    lengths, and pulls by those of the jobs it admitted last (:meth:`Scheduler.fetch_count`).
    """
    job_tokens = min(PLANNED_JOB_TOKENS, max(1, context_length))
    holds = rows_that_fit(budget_bytes, job_tokens, kv_bytes_per_token)
    short = min(CACHE_STEP, max(1, context_length))
    most = rows_that_fit(budget_bytes, short, kv_bytes_per_token)
    ceiling = BATCH_CEILING.get(backend, BATCH_CEILING["cpu"])
    memory = (
        f"a KV budget of {budget_bytes / 2**30:.1f} GiB holds {holds:,} jobs of "
        f"{job_tokens:,} tokens, {most:,} of {short:,}"
    )
    if given:
        more = "; admission waits for room beyond that" if given > holds else ""
        why = f"set by --max-batch ({memory}, the {backend} ceiling is {ceiling:,}{more})"
        return BatchChoice(given, "--max-batch", f"batch {given:,}: {why}")
    if most < ceiling:
        size = max(1, most)
        why = f"memory ({memory}, below the {backend} ceiling of {ceiling:,})"
        return BatchChoice(size, "memory", f"batch up to {size:,}: {why}")
    why = (
        f"the {backend} ceiling, where more rows stop paying; memory admits by the jobs' "
        f"real lengths ({memory})"
    )
    return BatchChoice(ceiling, "backend ceiling", f"batch up to {ceiling:,}: {why}")


def rows_that_fit(budget_bytes: int, tokens: int, kv_bytes_per_token: int) -> int:
    """The most jobs of ``tokens`` tokens whose slot cache (:func:`slot_cache_bytes`) fits
    ``budget_bytes``; 0 if not even one does."""
    rows = budget_bytes // max(1, cache_positions(tokens) * kv_bytes_per_token)
    if rows > ROW_STEP:
        return rows // ROW_STEP * ROW_STEP
    return 1 << (rows.bit_length() - 1) if rows else 0


@dataclass
class Scheduler:
    """Admission against a batch-size cap and a KV memory budget."""

    max_batch: int
    kv_bytes_per_token: int
    budget_bytes: int
    context_length: int
    prefetch: int = 8
    auto_prefill: bool = False  # size the prefill batch from the waiting prompts
    prefill_step: int = 2048
    prefill_tokens: int = PREFILL_TOKENS["cuda"]  # per prefill call, when automatic
    _reserved: dict[str, int] = field(default_factory=dict)  # worst-case tokens by job
    _samples: dict[str, int] = field(default_factory=dict)  # rows of jobs of n > 1 samples
    # Worst-case tokens of the jobs admitted last, and the longest of them: what the next
    # pull is planned by (read by the worker's thread, so a plain int beside the deque).
    _recent: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_JOBS))
    _recent_longest: int = 0
    # The prefill batch sized last (automatic), prefetched beyond the batch when larger
    # than ``prefetch``: read by the worker's thread, a plain int.
    _prefill_size: int = 0

    def job_bytes(self, prompt_tokens: int, max_tokens: int, rows: int = 1) -> int:
        """Worst-case KV bytes of one job alone (``rows``: its samples)."""
        return slot_cache_bytes(rows, prompt_tokens + max_tokens, self.kv_bytes_per_token)

    def fits_alone(self, prompt_tokens: int, max_tokens: int, rows: int = 1) -> str | None:
        """None if the job (of ``rows`` samples) can ever run here, else a message saying
        why not."""
        total = prompt_tokens + max_tokens
        if total > self.context_length:
            return (
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"the model's context length ({self.context_length}); shorten the prompt or "
                "lower max_tokens"
            )
        need = self.job_bytes(prompt_tokens, max_tokens, rows)
        if need > self.budget_bytes:
            fewer = "lower max_tokens or n" if rows > 1 else "lower max_tokens"
            return (
                f"needs {need / 2**20:.0f} MiB of KV cache but this worker's budget is "
                f"{self.budget_bytes / 2**20:.0f} MiB; {fewer} or run it on a "
                "machine with more memory"
            )
        return None

    @property
    def active(self) -> int:
        """Rows of the jobs admitted and not yet released (a job of ``n`` samples takes n)."""
        return len(self._reserved) + sum(self._samples.values()) - len(self._samples)

    @property
    def reserved_bytes(self) -> int:
        """KV bytes the admitted jobs' cache may reach: its rows for them, each as long as
        the longest's worst case (:func:`slot_cache_bytes`)."""
        longest = max(self._reserved.values(), default=0)
        return slot_cache_bytes(self.active, longest, self.kv_bytes_per_token)

    def fetch_count(self, held: int) -> int:
        """How many more jobs to pull from Redis when ``held`` are already in hand.

        Some beyond the batch size are prefetched so a finished job's slot is filled at
        the next step, not after a Redis round trip: ``prefetch``, or one automatic
        prefill call's worth if more (at most the batch size), so that rows ending
        together (equal lengths, short answers) refill at once instead of a few at a
        time, staggered (a uniform 1B run on a GPU: 561 steps instead of 512, 2.14x
        instead of 2.45x raw mlx-lm's tok/s with the whole wave prefetched:
        bench/RESULTS.md). The batch size here is what memory holds of jobs as long as
        the ones admitted last (:meth:`planned_rows`): a worker does not hold jobs it
        could not admit for long while other workers idle.
        """
        ahead = max(self.prefetch, self._prefill_size)
        return max(0, self.planned_rows() + ahead - held)

    def planned_rows(self) -> int:
        """The rows the batch can reach with jobs like the last :data:`RECENT_JOBS`
        admitted (before any, jobs of :data:`PLANNED_JOB_TOKENS`): ``max_batch``, or fewer
        where the memory budget holds fewer of them (at least one)."""
        tokens = self._recent_longest or min(PLANNED_JOB_TOKENS, self.context_length)
        fit = rows_that_fit(self.budget_bytes, tokens, self.kv_bytes_per_token)
        return max(1, min(self.max_batch, fit))

    def try_admit(self, key: str, prompt_tokens: int, max_tokens: int, rows: int = 1) -> bool:
        """Admit the job if its batch rows (``rows``: its samples) and their memory are
        free; record the reservation."""
        if self._reserved and self.active + rows > self.max_batch:
            return False
        tokens = prompt_tokens + max_tokens
        longest = max(tokens, *self._reserved.values(), 0)
        # An empty batch always takes one job that fits alone, so nothing starves.
        need = slot_cache_bytes(self.active + rows, longest, self.kv_bytes_per_token)
        if self._reserved and need > self.budget_bytes:
            return False
        self._reserved[key] = tokens
        self._recent.append(tokens)
        self._recent_longest = max(self._recent)
        if rows > 1:
            self._samples[key] = rows
        return True

    def prefill_batch(self, waiting_prompt_lengths: list[int]) -> int | None:
        """The prefill batch to use for these waiting prompts (None: leave it as it is)."""
        if not self.auto_prefill or not waiting_prompt_lengths:
            return None
        self._prefill_size = auto_prefill_batch(
            waiting_prompt_lengths, self.max_batch, self.prefill_step, self.prefill_tokens
        )
        return self._prefill_size

    def release(self, key: str) -> None:
        """Free a finished job's slots and memory."""
        self._reserved.pop(key, None)
        self._samples.pop(key, None)
