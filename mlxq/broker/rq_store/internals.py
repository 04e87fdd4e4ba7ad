"""The private attributes of RQ that mlxq relies on, each behind one function: check them
when upgrading RQ."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from rq import worker_registration
from rq.job import Job
from rq.queue import Queue
from rq.registry import clean_registries
from rq.utils import now
from rq.worker import BaseWorker


def ordered_queues(worker: BaseWorker) -> list[Queue]:
    """The worker's queues in dequeue order (RQ keeps no public accessor)."""
    return worker._ordered_queues


def pull_only(worker: BaseWorker, names: Collection[str]) -> None:
    """Dequeue only from these of the worker's queues, in its order (a worker of several
    models pulls for the loaded one); it still serves, sweeps and lists them all."""
    worker._ordered_queues = [q for q in worker.queues if q.name in names]


# RQ's BaseWorker keeps its stop flag, signal set-up and pubsub error handler private; the
# batch loop needs them. (mlxq's worker also overrides BaseWorker._shutdown, the hook RQ's
# signal handler calls: check it too when upgrading RQ.)
def request_stop(worker: BaseWorker) -> None:
    """Ask the worker's loop to stop after this pass (what RQ's warm shutdown does)."""
    worker._stop_requested = True


def stop_requested(worker: BaseWorker) -> bool:
    """Whether a warm shutdown was asked for."""
    return bool(worker._stop_requested)


def install_signal_handlers(worker: BaseWorker) -> None:
    """RQ's SIGTERM/SIGINT handlers (warm shutdown, then a forced one)."""
    worker._install_signal_handlers()


def pubsub_error_handler(worker: BaseWorker) -> Any:
    """RQ's handler that keeps the command channel's thread alive through Redis errors."""
    return worker._pubsub_exception_handler


def meta_unreadable(job: Job) -> bool:
    """Whether RQ could not deserialize the job's meta (``Job.restore`` then keeps the raw
    bytes aside and makes ``meta`` a stand-in dict)."""
    return getattr(job, "_unreadable_meta", None) is not None


def enqueue_again(queue: Queue, job: Job, pipe: Any, at_front: bool) -> None:
    """Put an existing job back on its queue (RQ's own requeue path, without its checks)."""
    queue._enqueue_job(job, pipeline=pipe, at_front=at_front)


def clean_registries_but_intermediate(worker: BaseWorker) -> None:
    """RQ's ``BaseWorker.clean_registries`` (RQ 3.0) less its intermediate-queue cleanup,
    which fails a job stranded there; mlxq's sweep puts it back instead
    (``recovery.requeue_stranded``)."""
    for queue in worker.queues:
        if queue.acquire_maintenance_lock():  # one worker per queue at a time
            worker.log.info("Worker %s: cleaning registries for queue: %s", worker.name, queue.name)
            clean_registries(queue, worker._exc_handlers)
            worker_registration.clean_worker_registry(queue)
            queue.release_maintenance_lock()
    worker.last_cleaned_at = now()
