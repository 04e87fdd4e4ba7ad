"""The fallback engine: mlx-lm's ``BatchGenerator`` with per-job settings.

It runs the models whose cache cannot live in slots (:mod:`mlxq.engine.factory` picks it).
One thread owns a :class:`BatchGeneratorEngine`: it ``add``s jobs, calls ``step`` in a loop and gets
back the jobs that finished. Jobs join the running batch between decode steps. Each job
has its own sampler, logits processors, ``max_tokens``, stop strings and logprobs; EOS
tokens end a job (and are not part of its output). A job that cannot run fails alone,
and an error inside the model fails the jobs in the batch but not the engine.

With ``prefix_cache_bytes``, jobs start from the stored KV cache of a recurring prompt
prefix and prefill only the rest (:mod:`mlxq.engine.prefix_cache`): ``add`` then queues a job,
and the next ``step`` plans its reuse, once a burst of jobs has been counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors

from mlxq.engine.constraints.batch import logits_width
from mlxq.engine.constraints.grammar import ConstraintError
from mlxq.engine.constraints.mlx_lm_hook import BatchGeneratorConstraints
from mlxq.engine.models.facts import model_info
from mlxq.engine.prefix_cache import Plan, make_prefix_cache
from mlxq.engine.prompts import JobInputError, PromptEncoder, error_line
from mlxq.engine.protocol import warm_up
from mlxq.engine.sampling import (
    Completion,
    EngineJob,
    RunningJob,
    StreamChunk,
    make_job_sampler,
    token_logprobs,
)
from mlxq.engine.stats import EngineStats, add_work
from mlxq.wire import FinishReason, Request, TokenLogprob


class BatchGeneratorEngine:
    """Continuous batching of generation jobs over one model; used by one thread."""

    def __init__(
        self,
        model: str,
        *,
        max_batch: int = 32,
        prefill_batch: int = 8,
        prefill_step: int = 2048,
        adapter_path: str | None = None,
        prefix_cache_bytes: int = 0,
    ) -> None:
        """Load ``model`` (a local folder or hub id) with ``mlx_lm.load``.

        ``prefix_cache_bytes`` > 0 keeps the KV cache of recurring prompt prefixes, up to
        that many bytes, and starts later jobs from it (see :mod:`mlxq.engine.prefix_cache`).
        """
        loaded, tokenizer = mlx_lm.load(model, adapter_path=adapter_path)
        sizes = {"max_batch": max_batch, "prefill_batch": prefill_batch}
        sizes |= {"prefill_step": prefill_step, "prefix_cache_bytes": prefix_cache_bytes}
        self._setup(loaded, tokenizer, model, **sizes)

    @classmethod
    def from_loaded(
        cls, model: nn.Module, tokenizer: Any, name: str, **options: int
    ) -> BatchGeneratorEngine:
        """An engine over a loaded model and ``TokenizerWrapper`` (same keyword options)."""
        engine = cls.__new__(cls)
        engine._setup(model, tokenizer, name, **options)
        return engine

    def _setup(
        self,
        model: nn.Module,
        tokenizer: Any,
        name: str,
        *,
        max_batch: int = 32,
        prefill_batch: int = 8,
        prefill_step: int = 2048,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.info = model_info(model, name, vocab_size=len(tokenizer))
        self._prompts = PromptEncoder(tokenizer, self.info)
        self.max_batch, self.prefill_batch = max_batch, prefill_batch
        self.prefill_step = prefill_step
        self._eos = sorted(tokenizer.eos_token_ids)
        self._runs: dict[int, RunningJob] = {}  # by BatchGenerator uid
        self._uids: dict[str, int] = {}  # job key -> uid
        # With a prefix cache, jobs wait here until the next step plans their reuse.
        self._queued: dict[str, RunningJob] = {}
        self._chunks: list[StreamChunk] = []  # stream jobs' new output, see take_stream
        self._prefix = make_prefix_cache(model, self.info, prefix_cache_bytes)
        self._stats = EngineStats()  # admitted prompts; the generators' work, step by step
        # [constraints] Structured outputs (response_format): the matchers, keyed by uid.
        self._constraints = BatchGeneratorConstraints(tokenizer, logits_width(model, tokenizer))
        self._gen = self._new_generator()

    def prefill_length(self, tokens: list[int]) -> int:
        """Tokens of this prompt the engine will likely prefill (less a cached prefix)."""
        return len(tokens) if self._prefix is None else self._prefix.uncached_length(tokens)

    def set_prefill_batch(self, n: int) -> None:
        """Prefill up to ``n`` prompts together from the next step on."""
        self.prefill_batch = max(1, min(n, self.max_batch))
        self._gen.prefill_batch_size = self.prefill_batch

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._constraints.wrap(self.model),  # [constraints]
            stop_tokens=[[t] for t in self._eos],
            sampler=greedy_sampler,
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.prefill_batch,
            prefill_step_size=self.prefill_step,
        )

    @property
    def active(self) -> int:
        """Jobs admitted and not finished (decoding, prefilling or waiting for a slot)."""
        return len(self._runs) + len(self._queued)

    def stats(self) -> EngineStats:
        """Counts of prompt, decode and prefix-cache work so far."""
        out = dataclasses.replace(self._stats)
        if self._prefix is not None:
            out = dataclasses.replace(out, **self._prefix.counts())
            out.prefill_seconds += self._prefix.seconds
        return out

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids; raises :class:`JobInputError` if it cannot run."""
        return self._prompts.encode(request)

    # -- running --

    def add(self, job: EngineJob, tokens: list[int] | None = None) -> Completion | None:
        """Admit a job into the running batch; an "error" Completion if it cannot run.

        ``tokens`` are the prompt's ids from :meth:`encode`, if already computed.
        Raises ``ValueError`` if a job with the same key is already running.
        """
        if job.key in self._uids or job.key in self._queued:
            raise ValueError(f"job {job.key} is already in the engine")
        now = time.time()
        try:
            if job.request.n > 1:  # (the slot engine prefills once for n rows; this one cannot)
                raise JobInputError(
                    f"n = {job.request.n}: several samples per request need the slot engine, "
                    "and this model runs on the BatchGenerator engine; write n lines of n=1"
                )
            tokens = self._prompts.prompt_tokens(job.request) if tokens is None else list(tokens)
            self._prompts.check_tokens(tokens, job.request.max_tokens)
            constraint = self._constraints.job(job.request.response_format)  # [constraints]
        except (JobInputError, ConstraintError) as exc:
            return Completion(job.key, "error", error=str(exc), admitted_at=now, finished_at=now)
        run = RunningJob.start(job, tokens, self.tokenizer, now)
        run.constraint = constraint
        self._stats.prompt_tokens += len(tokens)
        if self._prefix is not None:  # planned at the next step, once the burst is counted
            self._prefix.observe(tokens)
            self._queued[job.key] = run
            return None
        return self._insert(run)

    def _insert(self, run: RunningJob, plan: Plan | None = None) -> Completion | None:
        """Hand the job to the generator; an "error" Completion if it refuses."""
        req = run.job.request
        penalty = req.repetition_penalty
        processors = [] if penalty is None else make_logits_processors(repetition_penalty=penalty)
        row = None if run.constraint is None else self._constraints.processor(run.constraint)
        if row is not None:  # [constraints] after the penalty, before sampling
            processors.append(row)
        sampler = make_job_sampler(req, self.info.vocab_size)
        segments, cache, known = [run.prompt], None, []
        if plan is not None:  # start from a copy of the cached prefix
            segments, cache, known = plan.start(run.prompt)
        try:
            (uid,) = self._gen.insert_segments(
                [segments],
                [req.max_tokens],
                caches=[cache],
                all_tokens=[known],
                samplers=[sampler],
                logits_processors=[processors],
            )
        except Exception as exc:
            if plan is not None:
                plan.release()
            return run.completion("error", "", f"could not start the job: {error_line(exc)}")
        run.plan = plan
        if row is not None:  # [constraints]
            self._constraints.track(uid, row)
        self._runs[uid] = run
        self._uids[run.job.key] = uid
        return None

    def _feed(self) -> list[Completion]:
        """Plan and insert the queued jobs, except those waiting for a pending prefix."""
        assert self._prefix is not None  # only a prefix cache queues jobs
        failed = []
        for key, run in list(self._queued.items()):
            if (plan := self._prefix.plan(run.prompt)) is None:
                continue
            del self._queued[key]
            if (c := self._insert(run, plan)) is not None:
                failed.append(c)
        return failed

    def _store_prefixes(self, responses: list[Any]) -> None:
        """Copy prefixes into the prefix cache as their jobs' first segments end."""
        for r in responses:
            run = self._runs.get(r.uid)
            if run is None or run.plan is None or not run.plan.store or not r.end_of_segment:
                continue
            for cache, tokens in self._gen.extract_cache([r.uid]).values():
                run.plan.owner.store(run.plan, cache, tokens, run.prompt)

    def step(self) -> list[Completion]:
        """One ``BatchGenerator.next()``: a decode step and/or a prefill chunk.

        Returns the jobs that finished in this step.
        """
        done = self._feed() if self._queued else []
        if not self._runs:
            return done
        try:
            with self._gen.stats() as work:
                self._constraints.before_step(self._gen)  # [constraints]
                prompt_responses, responses = self._gen.next()
            self._constraints.after_step()  # [constraints]
        except Exception as exc:
            add_work(self._stats, work)
            return done + self._fail_batch(exc)
        add_work(self._stats, work)
        if self._prefix is not None:
            self._store_prefixes(prompt_responses)
        now = time.time()
        logprobs = self._logprobs(responses)
        for r in responses:
            run = self._runs.get(r.uid)
            if run is None:
                continue
            if run.first_token_at is None:
                run.first_token_at = now
            run.last_token_at = now
            reason = r.finish_reason
            # mlx-lm's "stop" is an EOS token: not part of the output.
            if reason != "stop" and run.add_token(r.token, logprobs.get(r.uid)):
                reason = "stop"
                self._gen.remove([r.uid])
            if reason is not None:
                done.append(self._finish(r.uid, reason))
            elif run.job.request.stream:
                run.stream_update(self.tokenizer, self._chunks)
        for uid, why in self._constraints.failures().items():  # [constraints] that job only
            if uid in self._runs:
                self._gen.remove([uid])
                done.append(self._finish(uid, "error", why))
        return done

    def take_stream(self) -> list[StreamChunk]:
        """New output of stream jobs since the last call (finished jobs excluded: their
        Completion has the rest)."""
        chunks, self._chunks = self._chunks, []
        return chunks

    def _logprobs(self, responses: list[Any]) -> dict[int, TokenLogprob]:
        """Logprobs of the tokens of the jobs that asked for them, by uid."""
        wanted = [
            (r, n)
            for r in responses
            if r.finish_reason != "stop"
            and (run := self._runs.get(r.uid)) is not None
            and (n := run.job.request.logprobs) is not None
        ]
        if not wanted:
            return {}
        rows = token_logprobs(
            mx.stack([r.logprobs for r, _ in wanted]),
            [r.token for r, _ in wanted],
            [n for _, n in wanted],
        )
        return {r.uid: row for (r, _), row in zip(wanted, rows, strict=True)}

    def _finish(self, uid: int, reason: FinishReason, error: str | None = None) -> Completion:
        run = self._runs.pop(uid)
        del self._uids[run.job.key]
        self._constraints.drop(uid)  # [constraints]
        if run.plan is not None:
            run.plan.release()  # a prefix it did not get to store
        return run.finish(reason, self.tokenizer, self._chunks, error)

    def _fail_batch(self, exc: Exception) -> list[Completion]:
        """Fail the jobs the model was working on; keep the waiting ones on a new generator."""
        waiting = {seq[0] for seq in getattr(self._gen, "_unprocessed_sequences", ())}
        error = f"generation failed for the whole batch: {error_line(exc)}"
        failed = [
            self._finish(uid, "error", error) for uid in list(self._runs) if uid not in waiting
        ]
        old, self._gen = self._gen, self._new_generator()
        with contextlib.suppress(Exception):  # the old generator is broken anyway
            old.close()
        mx.clear_cache()
        requeued = {}
        for uid in sorted(waiting & self._runs.keys()):
            run = self._runs.pop(uid)
            del self._uids[run.job.key]
            self._constraints.drop(uid)  # [constraints]
            if self._prefix is None:
                if (done := self._insert(run)) is not None:
                    failed.append(done)
                continue
            if run.plan is not None:
                run.plan.release()
            requeued[run.job.key] = run  # planned again at the next step, first in line
        self._queued = requeued | self._queued
        return failed

    def cancel(self, key: str) -> Completion | None:
        """Remove a job from the batch at once: a "cancelled" Completion, or None if unknown."""
        if (run := self._queued.pop(key, None)) is not None:
            return run.completion("cancelled", "")
        uid = self._uids.get(key)
        if uid is None:
            return None
        self._gen.remove([uid])
        return self._finish(uid, "cancelled")

    def warmup(self) -> None:
        """Run one tiny generation so that the first real jobs skip compile/alloc costs."""
        warm_up(self)

    def close(self) -> None:
        """Drop all jobs and release the generator."""
        self._runs.clear()
        self._uids.clear()
        self._queued.clear()
        if self._prefix is not None:
            self._prefix.clear()
        self._gen.close()
