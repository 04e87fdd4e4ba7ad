"""Python client for services: submit requests, fetch results, wait for batches.

from mlxq.client import Client
client = Client("redis://queue-host:6379/0")
batch = client.submit([{"prompt": "Hello", "max_tokens": 32}], queue="default")
for result in client.wait(batch.batch_id, timeout=600):
    print(result.custom_id, result.text)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec
import redis

from mlxq.broker import batches, keys
from mlxq.wire import BatchInfo, BatchStatus, Request, Result, StreamEntry


class Client:
    """A connection to the mlxq queues on one Redis."""

    def __init__(self, redis_url: str | None = None, connection: redis.Redis | None = None):
        if connection is None:
            url = redis_url or keys.redis_url_from_env()
            if not url:
                raise ValueError(
                    f"no Redis to talk to: pass redis_url or set {keys.ENV_REDIS_URL} "
                    "(e.g. redis://localhost:6379/0)"
                )
            connection = batches.connect(url)
        self.connection = connection

    def submit(
        self,
        requests: Iterable[Request | Mapping[str, Any]],
        *,
        queue: str = keys.DEFAULT_QUEUE,
        retries: int = 0,
        job_timeout: int = keys.DEFAULT_JOB_TIMEOUT,
        priority: str = keys.DEFAULT_PRIORITY,
    ) -> BatchInfo:
        """Validate and enqueue requests as one batch (dicts are checked like file lines).
        Workers take a higher ``priority``'s jobs first (``"high"``, ``"normal"``,
        ``"low"``); batches of equal priority share them a job at a time."""
        settings = {"retries": retries, "job_timeout": job_timeout, "priority": priority}
        return self._submit(requests, queue=queue, **settings)[0]

    def _submit(
        self, requests: Iterable[Request | Mapping[str, Any]], **kwargs: Any
    ) -> tuple[BatchInfo, list[str]]:
        reqs = [_as_request(r, i) for i, r in enumerate(requests)]
        ids: list[str] = []
        return batches.submit(self.connection, reqs, on_jobs=ids.extend, **kwargs), ids

    def submit_one(self, request: Request | Mapping[str, Any], **kwargs: Any) -> str:
        """Enqueue one request; returns its job id."""
        return self._submit([request], **kwargs)[1][0]

    def result(self, job_id: str, timeout: float = 0) -> Result | None:
        """The job's result, waiting up to ``timeout`` seconds; None if not done by then."""
        deadline = time.monotonic() + timeout
        while True:
            result = batches.fetch_results(self.connection, [job_id])[0]
            if result is not None or time.monotonic() >= deadline:
                return result
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def stream(self, job_id: str) -> Iterator[StreamEntry]:
        """A ``stream: true`` job's output as it is generated; the last entry has
        ``finish_reason``."""
        from mlxq.broker import streams

        return streams.follow(self.connection, job_id)

    def status(self, batch_id: str) -> BatchStatus:
        """Counts of a batch's jobs by state."""
        return batches.batch_status(self.connection, batch_id)

    def results(self, batch_id: str) -> list[Result | None]:
        """The batch's results so far, in input order (None where not done)."""
        return list(batches.iter_batch_results(self.connection, batch_id))

    def wait(self, batch_id: str, timeout: float | None = None) -> list[Result]:
        """Wait for every job of the batch and return all results in input order."""
        batches.wait_for_batch(self.connection, batch_id, timeout=timeout)
        return [r for r in self.results(batch_id) if r is not None]


def _as_request(obj: Request | Mapping[str, Any], index: int) -> Request:
    """A Request from a Request, an mlxq dict, or an OpenAI Batch API line; its
    ``response_format`` must be one the engine can enforce."""
    if isinstance(obj, Request):
        req = obj
    elif "body" in obj and "url" in obj:
        from mlxq.formats.inputs import request_from_openai

        return request_from_openai(dict(obj), index)  # (checks response_format)
    else:
        try:
            req = msgspec.convert(dict(obj), Request)
        except msgspec.ValidationError as e:
            raise ValueError(f"request {index}: {e}") from e
    if req.response_format is not None:
        from mlxq.engine.constraints.grammar import constraint_problem

        if problem := constraint_problem(req.response_format):
            raise ValueError(f"request {index}: {problem}")
    return req
