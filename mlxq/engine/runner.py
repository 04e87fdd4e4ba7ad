"""The MLX thread: owns the engine and runs its decode loop; other threads hand it work.

MLX state (model, KV caches, streams) is touched only by this thread. The worker's
Redis thread submits ``Work`` and cancels through a queue and collects ``Completion``s
from another, so Redis round trips never stall a decode step.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx

from mlxq.engine.eval_order import widen
from mlxq.engine.gil import shorten_switch_interval
from mlxq.engine.hardware import DeviceFacts, device_facts
from mlxq.engine.protocol import BatchEngine
from mlxq.engine.sampling import Completion, EngineJob, StreamChunk
from mlxq.engine.scheduler import Scheduler, admission_order
from mlxq.errors import StartupError, one_line
from mlxq.wire import ModelInfo

log = logging.getLogger("mlxq.engine.runner")

# How long the idle MLX thread sleeps on its inbox before checking for stop.
IDLE_WAIT_S = 0.1


@dataclass
class Work:
    """A job handed to the MLX thread, already tokenized by the caller."""

    job: EngineJob
    tokens: list[int]


@dataclass
class _Cancel:
    key: str


@dataclass
class _Withdraw:
    reply: queue.Queue[list[str]]  # gets the keys of the jobs taken back


# Builds the next engine and its scheduler on the MLX thread (``Runner.replace``).
Build = Callable[[DeviceFacts], tuple[BatchEngine, Scheduler]]


@dataclass
class _Replace:
    build: Build
    done: Future[ModelInfo]


class Runner:
    """Runs a :class:`BatchEngine` on its own thread with scheduler-driven admission."""

    def __init__(
        self,
        make_engine: Callable[[DeviceFacts], BatchEngine],
        make_scheduler: Callable[[BatchEngine, DeviceFacts], Scheduler],
    ) -> None:
        self._make_engine = make_engine
        self._make_scheduler = make_scheduler
        self._inbox: queue.SimpleQueue[list[Work] | _Cancel | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._stream: queue.SimpleQueue[StreamChunk] = queue.SimpleQueue()
        self._pending: deque[Work] = deque()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mlxq-mlx", daemon=True)
        self.engine: BatchEngine | None = None
        self.scheduler: Scheduler | None = None
        self.facts: DeviceFacts | None = None  # set when the engine starts
        self.memory: tuple[int, int] = (0, 0)  # MLX (active, peak) bytes, sampled each second
        self._memory_at = 0.0
        # Monotonic time of the MLX thread's last completed pass (a step, or an idle wait):
        # the worker's stall watchdog reads it.
        self.last_progress = time.monotonic()
        # Seconds the MLX thread waited with no job running or pending: the engine starved
        # (a worker that cannot feed it fast enough shows here, not in the engine's stats).
        self.idle_seconds = 0.0
        self._in_engine = False  # in a step, or a distributed engine's ping

    # -- called from other threads -------------------------------------------------
    def start(self) -> ModelInfo:
        """Start the thread, load the model on it, and return the model's facts."""
        self._thread.start()
        self._ready.wait()
        if isinstance(self._error, StartupError):
            raise self._error
        if self._error is not None:
            raise StartupError(
                f"could not start the engine: {one_line(self._error)} (run with --log-level "
                "debug for the traceback)"
            ) from self._error
        assert self.engine is not None
        return self.engine.info

    def submit(self, works: list[Work]) -> None:
        """Queue tokenized jobs for admission into the running batch, as one group."""
        self._inbox.put(works)

    def cancel(self, key: str) -> None:
        """Stop a job at the next step; its Completion says ``cancelled``."""
        self._inbox.put(_Cancel(key))

    def withdraw_pending(self, timeout: float = 10.0) -> list[str]:
        """Take back every job handed over but not admitted into the batch yet (a stopping
        worker puts them back on their queues rather than run them); their keys. Jobs
        submitted before this call are among them; an MLX thread that does not answer
        within ``timeout`` seconds (a long step) keeps them all."""
        reply: queue.Queue[list[str]] = queue.Queue(maxsize=1)
        self._inbox.put(_Withdraw(reply))
        try:
            return reply.get(timeout=timeout)
        except queue.Empty:
            return []

    def replace(self, build: Build) -> Future[ModelInfo]:
        """Close the engine (its KV cache freed) and run ``build``'s engine and scheduler
        instead, on the MLX thread; the future holds the new model's facts, or the error
        (the MLX thread then stops). Only for an engine with no jobs, none pending: a worker
        switching models stops taking jobs and lets its running ones finish first."""
        done: Future[ModelInfo] = Future()
        self._inbox.put(_Replace(build, done))
        return done

    @property
    def holds_work(self) -> bool:
        """Whether the MLX thread has jobs, running or waiting, or is in a call to the
        engine (a step, a ping of other ranks), which may hang with no job left (read from
        another thread: a snapshot, enough for the worker's stall watchdog)."""
        engine = self.engine
        return self._in_engine or bool(self._pending) or (engine is not None and engine.active > 0)

    def completions(self, timeout: float = 0.0) -> list[Completion]:
        """Finished jobs, waiting up to ``timeout`` seconds for the first one."""
        out: list[Completion] = []
        try:
            out.append(
                self._outbox.get(timeout=timeout) if timeout > 0 else self._outbox.get_nowait()
            )
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._outbox.get_nowait())
            except queue.Empty:
                return out

    def stream_chunks(self) -> list[StreamChunk]:
        """New output of ``stream: true`` jobs, oldest first (never waits)."""
        out: list[StreamChunk] = []
        while True:
            try:
                out.append(self._stream.get_nowait())
            except queue.Empty:
                return out

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the MLX thread to exit and wait for it."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the MLX thread is running."""
        return self._thread.is_alive() and self._error is None

    # -- the MLX thread --------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._run()
        finally:
            # MLX keeps a compile cache per thread, holding Python objects; left to the
            # thread's exit it takes the GIL after Python may have begun to finalize, and the
            # process aborts (exit 134). MLX asks each thread to clear its own.
            mx.clear_streams()

    def _run(self) -> None:
        try:
            shorten_switch_interval()  # this thread takes the GIL back after every eval
            self.facts = device_facts()
            widen(self.facts.backend)  # (before the model loads: MLX reads it once)
            self.engine = self._make_engine(self.facts)
            self.scheduler = self._make_scheduler(self.engine, self.facts)
        except BaseException as e:  # reported to start()'s caller
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not self._pending and self.engine.active == 0:
                    waited = time.perf_counter()
                    self._take_inbox(block=True)
                    self.idle_seconds += time.perf_counter() - waited
                else:
                    self._take_inbox(block=False)
                self._admit()
                self._in_engine = True  # (a call that hangs: work the stall watchdog sees)
                try:
                    self._engine_pass()
                finally:
                    self._in_engine = False
                self._sample_memory()
                self.last_progress = time.monotonic()
        except BaseException as e:
            log.exception("MLX thread stopped on an unexpected error")
            self._error = e
        finally:
            if self.engine is not None:
                self.engine.close()

    def _engine_pass(self) -> None:
        """A step of the jobs, or (none running) a distributed engine's ping of its other
        ranks. Either can hang with no job left: a step whose last rows just ended clears
        MLX's cache, which waits for every stream, and a pipeline's relay stream can hold
        a send to a rank that is gone; so can a ping."""
        assert self.engine is not None
        if self.engine.active:
            done = self.engine.step()
            for chunk in self.engine.take_stream():
                self._stream.put(chunk)
            self._emit(done)
        elif (idle := getattr(self.engine, "idle", None)) is not None:
            idle()

    def _sample_memory(self) -> None:
        if time.monotonic() - self._memory_at >= 1.0:
            self._memory_at = time.monotonic()
            self.memory = (mx.get_active_memory(), mx.get_peak_memory())

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        arrived = False
        while item is not None:
            if isinstance(item, _Cancel):
                self._cancel(item.key)
            elif isinstance(item, _Withdraw):
                item.reply.put([w.job.key for w in self._pending])
                self._pending.clear()
            elif isinstance(item, _Replace):
                self._replace(item)
            else:
                order = admission_order([len(w.tokens) for w in item])
                self._pending.extend(item[i] for i in order)
                arrived = True
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        if arrived:
            self._size_prefill()

    def _replace(self, item: _Replace) -> None:
        """Swap the engine (``replace``); a failed build stops this thread."""
        assert self.engine is not None and self.facts is not None
        if self._pending or self.engine.active:
            item.done.set_exception(RuntimeError("the engine still has jobs: not replaced"))
            return
        # The scheduler stays for readers (the worker publishes it) until the new one is set.
        self.engine.close()
        self.engine = None
        gc.collect()  # the old engine's arrays, before the next model's take their place
        mx.clear_cache()
        try:
            engine, scheduler = item.build(self.facts)
        except BaseException as e:
            item.done.set_exception(e)
            raise
        self.engine, self.scheduler = engine, scheduler
        self.last_progress = time.monotonic()
        item.done.set_result(engine.info)

    def _size_prefill(self) -> None:
        """Resize the prefill batch for the jobs waiting now (once per arrival, not per
        step: it walks the prefix cache for every waiting prompt)."""
        assert self.engine is not None and self.scheduler is not None
        lengths = [self.engine.prefill_length(w.tokens) for w in self._pending]
        size = self.scheduler.prefill_batch(lengths)
        if size is not None and size != self.engine.prefill_batch:
            self.engine.set_prefill_batch(size)

    def _cancel(self, key: str) -> None:
        assert self.engine is not None
        for work in self._pending:
            if work.job.key == key:
                self._pending.remove(work)
                self._emit([Completion(key=key, finish_reason="cancelled")])
                return
        done = self.engine.cancel(key)
        if done is not None:
            self._emit([done])

    def _admit(self) -> None:
        """Move pending jobs into the batch while the scheduler has room (in order)."""
        assert self.engine is not None and self.scheduler is not None
        while self._pending:
            work = self._pending[0]
            request = work.job.request
            rows = request.n  # (a row per sample)
            if not self.scheduler.try_admit(
                work.job.key, len(work.tokens), request.max_tokens, rows
            ):
                return
            self._pending.popleft()
            failed = self.engine.add(work.job, work.tokens)
            if failed is not None:
                self._emit([failed])

    def _emit(self, completions: list[Completion]) -> None:
        assert self.scheduler is not None
        for c in completions:
            self.scheduler.release(c.key)
            self._outbox.put(c)
