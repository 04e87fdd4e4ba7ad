"""Records mlxq keeps in Redis beside RQ's jobs: job meta, batches, workers, queues, models."""

from __future__ import annotations

from msgspec import Struct


class JobMeta(Struct, omit_defaults=True):
    """What mlxq keeps in an RQ job's ``meta``: where the job belongs."""

    batch_id: str | None = None
    index: int | None = None
    custom_id: str | None = None
    expires_at: float | None = None  # Unix time after which the request is not run


class BatchModel(Struct, omit_defaults=True):
    """One model of a batch: how many of its lines name it (``model`` None: the lines that
    name none) and the queue they went to."""

    queue: str
    lines: int
    model: str | None = None


class BatchInfo(Struct):
    """A batch: its jobs are listed, in input order, under ``keys.batch_jobs``.

    The record is written first, ``state`` ``submitting``; it becomes ``submitted`` once all
    ``total`` jobs are enqueued (a submit that died half way leaves it ``submitting``, to be
    resumed or cancelled), or ``cancelled`` if cancelled before that. ``digest`` identifies
    the requests, so a resume can refuse a different file; the job settings are kept so a
    resume enqueues the rest exactly as the first part. ``models`` lists the models its
    lines name, in order of first appearance, with their queues: lines that name none, or
    ``model``, go to ``queue`` (records written before batches could mix models have none).
    """

    batch_id: str
    queue: str
    total: int
    created_at: float
    source: str | None = None
    model: str | None = None
    expires_at: float | None = None
    state: str = "submitted"
    digest: str | None = None
    retries: int = 0
    job_timeout: int | None = None
    result_ttl: int | None = None
    # high, normal or low (``keys.PRIORITIES``): workers take a higher priority's jobs first
    # and share out equal priorities' batches a job at a time.
    priority: str = "normal"
    models: list[BatchModel] = []

    def queues(self) -> list[str]:
        """Every queue the batch's jobs went to, in order of first appearance."""
        return list(dict.fromkeys(m.queue for m in self.models)) or [self.queue]


class ModelProgress(Struct):
    """The jobs of one queue of a batch: the models its lines named (the batch's ``model``,
    or ``(none)``, for lines naming none), how many, and ``counts`` by state (``queued``,
    ``started``, ``finished``, ``failed``, ``cancelled``, ``expired``; here ``failed``
    does not include ``expired``)."""

    queue: str
    models: list[str]
    total: int
    counts: dict[str, int]

    @property
    def done(self) -> int:
        """Jobs that will not change any more."""
        return sum(self.counts[k] for k in ("finished", "failed", "cancelled", "expired"))


class BatchStatus(Struct):
    """Counts of a batch's jobs by state.

    ``failed`` includes the ``expired`` ones (requests whose batch expired before they
    ran). ``enqueued`` is how many of ``total`` are in Redis: fewer while ``state`` is
    ``submitting`` (``submitter_alive`` says whether a submit is still enqueueing them).
    ``models`` has the counts per queue (one per model) of a batch whose lines name models.
    """

    batch_id: str
    total: int
    queued: int
    started: int
    finished: int
    failed: int
    cancelled: int = 0
    other: int = 0
    expired: int = 0
    state: str = "submitted"
    enqueued: int | None = None
    submitter_alive: bool = False
    priority: str = "normal"
    models: list[ModelProgress] = []

    @property
    def done(self) -> int:
        """Jobs that will not change any more."""
        return self.finished + self.failed + self.cancelled


class ModelInfo(Struct):
    """Facts about a loaded model that scheduling and logs need (no MLX types)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    kv_bytes_per_token: int
    param_bytes: int
    dtype: str


class WorkerInfo(Struct):
    """What a live worker publishes about itself (``keys.worker_info``), refreshed with
    its heartbeat and expiring when the worker dies."""

    name: str
    host: str
    pid: int
    model: str
    queues: list[str]
    backend: str  # metal, cuda or cpu
    device: str
    memory_bytes: int
    max_batch: int
    kv_budget_bytes: int
    kv_reserved_bytes: int
    in_flight: int
    jobs_done: int
    jobs_failed: int
    tokens_generated: int
    recent_tps: float  # generated tokens/s over the last minute or so
    started_at: float
    heartbeat_at: float
    adapter_path: str | None = None
    # "stalled": its MLX thread stopped making progress with jobs in flight; the worker
    # put its jobs back and exited (the record stays a while so `mlxq workers` shows it).
    # "paused": it takes no new jobs while Redis may evict keys (its log says the fix).
    state: str = "running"
    # Seconds since the MLX thread last completed a step (while jobs are in flight).
    step_age_s: float | None = None
    # What it holds of its machine's memory (weights + KV budget + prefix cache) and which
    # memory that is (DeviceFacts.memory_domain): a worker starting on the same host sizes
    # itself from what is left.
    memory_claimed_bytes: int = 0
    memory_domain: str = "system"
    # Batch rows in use now (the scheduler's admitted jobs, a row per sample); ``in_flight``
    # also counts jobs pulled early that wait for a row. None from older workers.
    decoding: int | None = None
    # Every model it serves (``model`` is the one loaded now; ``queues`` holds all their
    # queues). Empty from older workers and workers of one model.
    models: list[str] = []


class SeenModel(Struct):
    """A model some worker served, with that worker's queues and LoRA adapter, when last
    seen alive (``keys.models_seen``)."""

    model: str
    queues: list[str]
    seen_at: float
    adapter: str | None = None  # the worker's adapter on the model (routing skips its queues)


class QueueInfo(Struct):
    """One RQ queue at a glance (``mlxq status`` without a batch id).

    ``queued`` is the queue's length; ``started``, ``finished`` and ``failed`` are the
    sizes of RQ's registries for it (``started`` counts executions, one per running job).
    ``oldest_enqueued_at`` (Unix seconds) and ``oldest_age_s`` describe the longest-waiting
    queued job, or are None when the queue is empty. ``workers`` is how many live mlxq
    workers serve the queue.
    """

    name: str
    queued: int
    started: int
    finished: int
    failed: int
    oldest_enqueued_at: float | None
    oldest_age_s: float | None
    workers: int = 0
