"""Token streams of ``stream: true`` jobs: written by workers, followed by `mlxq tail`.

Each job's stream (``keys.stream(job_id)``) holds entries with one ``data`` field, a JSON
``StreamEntry``: new text and token ids as they are generated, then a last entry with the
``finish_reason``. The stored result stays the authority on the final text (a stop string
can only be cut once it is complete, so its first characters may have been streamed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import redis

from mlxq.broker import keys
from mlxq.broker.rq_store import reads, states
from mlxq.wire import StreamChunk, StreamEntry, json_encoder

STREAM_TTL = 24 * 3600  # streams are for watching live; results keep the output for days
_entry = msgspec.json.Decoder(StreamEntry)


def publish(conn: redis.Redis, chunks: list[StreamChunk], ends: list[tuple[str, str]]) -> None:
    """Append new chunks, then the end markers ``(job_id, finish_reason)`` of finished
    stream jobs (one round trip)."""
    if not chunks and not ends:
        return
    with conn.pipeline(transaction=False) as pipe:
        for ch in chunks:
            _add(pipe, ch.key, StreamEntry(text=ch.text, token_ids=ch.token_ids))
        for job_id, reason in ends:
            _add(pipe, job_id, StreamEntry(finish_reason=reason))
        pipe.execute()


def _add(pipe: Any, job_id: str, entry: StreamEntry) -> None:
    pipe.xadd(keys.stream(job_id), {"data": json_encoder.encode(entry)})
    pipe.expire(keys.stream(job_id), STREAM_TTL)


def follow(conn: redis.Redis, job_id: str, block_ms: int = 1000) -> Iterator[StreamEntry]:
    """Yield a job's stream entries as they arrive, until its last one."""
    last = "0-0"
    while True:
        reply = conn.xread({keys.stream(job_id): last}, block=block_ms, count=100)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                entry = _entry.decode(fields[b"data"])
                yield entry
                if entry.finish_reason is not None:
                    return
        if not reply and _finished_without_stream(conn, job_id):
            return


def _finished_without_stream(conn: redis.Redis, job_id: str) -> bool:
    """A job that is done (or gone) and left no end marker will never stream more."""
    status = reads.job_status(conn, job_id)
    done = status == states.GONE or status in states.ENDED
    return done and not conn.exists(keys.stream(job_id))
