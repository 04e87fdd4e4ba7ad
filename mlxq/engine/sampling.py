"""Per-job pieces of the engine: jobs and their outcomes, samplers, stop strings, logprobs.

A :class:`RunningJob` is the engine's record of a job in the batch: the tokens (and
logprobs) generated so far and its watch for stop strings; it makes the job's
:class:`Completion`.

Samplers follow ``mlx_lm.sample_utils.make_sampler`` (the same top-p, min-p and top-k
filters, then categorical sampling at the temperature; greedy at temperature 0). A
request with a ``seed`` gets a sampler that owns its random key and splits it once per
token, so its samples do not depend on the other jobs in the batch; sample ``i`` of a
request with ``n`` samples is seeded ``seed + i``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler

from mlxq.engine.prefix_cache import Plan
from mlxq.wire import Choice, FinishReason, Request, StreamChunk, TokenLogprob, TopLogprob

Sampler = Callable[[mx.array], mx.array]
Filter = Callable[[mx.array], mx.array]
# Extra characters re-scanned for stop strings: streaming detokenizers may revise the
# last few characters of their text (held-back spaces, incomplete UTF-8).
_STOP_RESCAN = 8


@dataclass
class EngineJob:
    """One request to run, under a unique key (the RQ job id)."""

    key: str
    request: Request


@dataclass
class Completion:
    """The outcome of one job. Times are ``time.time()`` seconds.

    A job of ``n`` > 1 samples has ``choices`` (one per sample, in order); its text, token
    ids, logprobs and finish_reason are then choice 0's, unless the job was stopped whole.
    """

    key: str
    finish_reason: FinishReason
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    admitted_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float = 0.0
    prefill_seconds: float | None = None
    decode_seconds: float | None = None
    choices: list[Choice] | None = None

    @property
    def completion_tokens(self) -> int:
        """Tokens generated: every choice's, for a job of several samples."""
        if self.choices:
            return sum(len(c.token_ids) for c in self.choices)
        return len(self.token_ids)


@dataclass
class RunningJob:
    """A job in the batch: what it has generated so far.

    Only jobs with stop strings stream their text (``detokenizer``), to watch for them.
    """

    job: EngineJob
    prompt: list[int]
    detokenizer: Any | None
    admitted_at: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    scan_from: int = 0  # stop strings cannot start before this text offset
    plan: Plan | None = None  # its use of the prefix cache
    streamed_tokens: int = 0  # stream jobs: how much has been handed out
    streamed_chars: int = 0
    constraint: Any | None = None  # its JobConstraint (response_format), if any

    def add_token(self, token: int, logprob: TokenLogprob | None) -> bool:
        """Record one generated token; True when the text now contains a stop string."""
        self.tokens.append(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        if self.detokenizer is None:
            return False
        self.detokenizer.add_token(token)
        stops = self.job.request.stop
        text = self.detokenizer.text
        if find_stop(text, stops, self.scan_from) is not None:
            return True
        longest = max(len(s) for s in stops)
        self.scan_from = max(0, len(text) - longest - _STOP_RESCAN)
        return False

    @classmethod
    def start(cls, job: EngineJob, tokens: list[int], tokenizer: Any, now: float) -> RunningJob:
        """A job entering an engine (a detokenizer only if it has stop strings to watch)."""
        run = cls(job, tokens, tokenizer.detokenizer if job.request.stop else None, now)
        run.logprobs = None if job.request.logprobs is None else []
        return run

    def stream_update(self, tokenizer: Any, chunks: list[StreamChunk]) -> None:
        """Append the output not yet streamed to ``chunks`` (a stream job, each token)."""
        chunk = self.stream_chunk(tokenizer.decode(self.tokens).rstrip("\ufffd"))
        if chunk is not None:  # ("\ufffd": a character split across tokens, held back)
            chunks.append(chunk)

    def finish(
        self, reason: FinishReason, tokenizer: Any, chunks: list[StreamChunk], error: str | None
    ) -> Completion:
        """The job's Completion; a stream job's last output goes to ``chunks`` first."""
        # Like mlx_lm.batch_generate: decode the ids (keeps a leading space, unlike the
        # streaming detokenizers). A character cut in half by max_tokens decodes as U+FFFD:
        # dropped, as the streamed chunks hold it back, so the two always agree.
        done = self.completion(reason, tokenizer.decode(self.tokens).rstrip("\ufffd"), error)
        if self.job.request.stream:  # the rest of its output, before it is reported done
            rest_ids = done.token_ids[self.streamed_tokens :]
            rest_text = done.text[self.streamed_chars :]
            if rest_ids or rest_text:
                chunks.append(StreamChunk(self.job.key, rest_text, rest_ids))
        return done

    def stream_chunk(self, text: str) -> StreamChunk | None:
        """Output not yet streamed, given the decoded ``text`` of all tokens so far."""
        ids = self.tokens[self.streamed_tokens :]
        new_text = text[self.streamed_chars :]
        if not ids and not new_text:
            return None
        self.streamed_tokens = len(self.tokens)
        self.streamed_chars = max(self.streamed_chars, len(text))
        return StreamChunk(self.job.key, new_text, ids)

    def completion(self, reason: FinishReason, text: str, error: str | None = None) -> Completion:
        """The finished job, given the decoded ``text`` of its tokens.

        The text is cut before the first stop string; cancelled and failed jobs keep what
        they generated so far.
        """
        if reason in ("stop", "length"):  # the full decode may complete a stop string
            cut = find_stop(text, self.job.request.stop)
            if cut is not None:
                text, reason = text[:cut], "stop"
        first, last = self.first_token_at, self.last_token_at
        return Completion(
            key=self.job.key,
            finish_reason=reason,
            text=text,
            token_ids=self.tokens,
            prompt_tokens=len(self.prompt),
            logprobs=self.logprobs,
            error=error,
            admitted_at=self.admitted_at,
            first_token_at=first,
            finished_at=time.time(),
            prefill_seconds=None if first is None else first - self.admitted_at,
            decode_seconds=None if first is None or last is None else last - first,
        )


def _filters(request: Request, vocab_size: int) -> list[Filter]:
    """The logprob filters of a request, in mlx-lm's order."""
    filters: list[Filter] = []
    top_p, min_p, top_k = request.top_p, request.min_p, request.top_k
    if 0 < top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if 0 < top_k < vocab_size:  # top_k >= vocab keeps everything
        filters.append(lambda x: apply_top_k(x, top_k))
    return filters


def make_job_sampler(request: Request, vocab_size: int, sample: int = 0) -> Sampler:
    """The sampler of one job (of its ``sample``-th sample): greedy, or filtered
    categorical (seeded ``seed + sample`` if the request has a seed)."""
    if request.temperature == 0:
        return greedy_sampler  # one shared object: mlx-lm then samples the batch at once
    filters = _filters(request, vocab_size)
    inv_temp = 1.0 / request.temperature
    key = None if request.seed is None else mx.random.key(request.seed + sample)

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal key
        for f in filters:
            logprobs = f(logprobs)
        if key is None:
            return mx.random.categorical(logprobs * inv_temp)
        key, sub = mx.random.split(key)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sampler


def find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Offset of the earliest stop string in ``text[start:]``, or None."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def token_logprobs(logprobs: mx.array, tokens: list[int], ns: list[int]) -> list[TokenLogprob]:
    """Each row's chosen-token logprob and its top-n alternatives (best first).

    ``logprobs`` is (rows, vocab); ``tokens`` and ``ns`` have one entry per row. One
    evaluation for all rows.
    """
    k = min(max(ns), logprobs.shape[-1])
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    top = top_values = None
    if k > 0:
        top = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(logprobs, top, axis=-1)
    mx.eval([a for a in (chosen, top, top_values) if a is not None])
    out = []
    for i, (token, value) in enumerate(zip(tokens, chosen.tolist(), strict=True)):
        pairs = []
        if top is not None and ns[i] > 0:
            row = zip(top[i].tolist(), top_values[i].tolist(), strict=True)
            # (-inf: a token a constraint forbids, not an alternative)
            pairs = sorted(row, key=lambda p: (-p[1], p[0]))[: ns[i]]
            pairs = [p for p in pairs if p[1] != -math.inf]
        out.append(TokenLogprob(token, value, [TopLogprob(t, v) for t, v in pairs]))
    return out
