"""The continuous-batching runner: mlx-lm's ``BatchGenerator`` with per-job settings.

One thread owns an :class:`Engine`: it ``add``s jobs, calls ``step`` in a loop and gets
back the jobs that finished. Jobs join the running batch between decode steps. Each job
has its own sampler, logits processors, ``max_tokens``, stop strings and logprobs; EOS
tokens end a job (and are not part of its output). A job that cannot run fails alone,
and an error inside the model fails the jobs in the batch but not the engine.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors

from mlxq.sampling import find_stop, make_job_sampler, token_logprobs
from mlxq.types import FinishReason, ModelInfo, Request, TokenLogprob

# Used when a model's config does not say how long its context is.
DEFAULT_CONTEXT_LENGTH = 32768
# Extra characters re-scanned for stop strings: streaming detokenizers may revise the
# last few characters of their text (held-back spaces, incomplete UTF-8).
_STOP_RESCAN = 8
WARMUP_KEY = "__mlxq_warmup__"


@dataclass
class EngineJob:
    """One request to run, under a unique key (the RQ job id)."""

    key: str
    request: Request


@dataclass
class Completion:
    """The outcome of one job. Times are ``time.time()`` seconds."""

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


class JobInputError(ValueError):
    """A request this model cannot run; the message says what is wrong and how to fix it."""


@dataclass
class _Run:
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


def model_info(model: nn.Module, name: str, vocab_size: int = 0) -> ModelInfo:
    """Shape facts of a loaded mlx-lm model, read from its ``args``.

    ``vocab_size`` is used when the args do not say (the tokenizer's size).
    """
    args = vars(model.args) if hasattr(model, "args") else {}
    if isinstance(args.get("text_config"), dict):  # multimodal models nest the LM's config
        args = {**args["text_config"], **args}
    layers = len(model.layers)
    hidden = args.get("hidden_size", 0)
    heads = args.get("num_attention_heads", 0)
    kv_heads = args.get("num_key_value_heads") or heads
    head_dim = args.get("head_dim") or (hidden // heads if heads else 0)
    params = [v for _, v in tree_flatten(model.parameters())]
    floats = [v.dtype for v in params if mx.issubdtype(v.dtype, mx.floating)]
    dtype = floats[0] if floats else mx.float16
    return ModelInfo(
        name=name,
        model_type=str(args.get("model_type", type(model).__module__.rsplit(".", 1)[-1])),
        num_layers=layers,
        hidden_size=hidden,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=args.get("vocab_size") or vocab_size,
        context_length=args.get("max_position_embeddings") or DEFAULT_CONTEXT_LENGTH,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype.size,
        param_bytes=sum(v.nbytes for v in params),
        dtype=str(dtype).rsplit(".", 1)[-1],
    )


def _error_line(exc: BaseException) -> str:
    """An exception as one readable line, with a hint when memory ran out."""
    line = " ".join(f"{type(exc).__name__}: {exc}".split())
    if "memory" in line.lower() or "alloc" in line.lower():
        return f"{line} (out of memory: lower max_batch or prefill_step, or send shorter jobs)"
    return line


class Engine:
    """Continuous batching of generation jobs over one model; used by one thread."""

    def __init__(
        self,
        model: str,
        *,
        max_batch: int = 32,
        prefill_batch: int = 8,
        prefill_step: int = 2048,
        adapter_path: str | None = None,
    ) -> None:
        """Load ``model`` (a local folder or hub id) with ``mlx_lm.load``."""
        loaded, tokenizer = mlx_lm.load(model, adapter_path=adapter_path)
        batching = {"max_batch": max_batch, "prefill_batch": prefill_batch}
        self._setup(loaded, tokenizer, model, prefill_step=prefill_step, **batching)

    @classmethod
    def from_loaded(cls, model: nn.Module, tokenizer: Any, name: str, **batching: int) -> Engine:
        """An engine over a loaded model and ``TokenizerWrapper`` (same batching kwargs)."""
        engine = cls.__new__(cls)
        engine._setup(model, tokenizer, name, **batching)
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
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.info = model_info(model, name, vocab_size=len(tokenizer))
        self.max_batch, self.prefill_batch = max_batch, prefill_batch
        self.prefill_step = prefill_step
        self._eos = sorted(tokenizer.eos_token_ids)
        self._runs: dict[int, _Run] = {}  # by BatchGenerator uid
        self._uids: dict[str, int] = {}  # job key -> uid
        self._gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in self._eos],
            sampler=greedy_sampler,
            completion_batch_size=self.max_batch,
            prefill_batch_size=self.prefill_batch,
            prefill_step_size=self.prefill_step,
        )

    @property
    def active(self) -> int:
        """Jobs admitted and not finished (decoding, prefilling or waiting for a slot)."""
        return len(self._runs)

    # -- encoding (pure tokenizer work: safe to call from another thread) --

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids; raises :class:`JobInputError` if it cannot run."""
        tokens = self._prompt_tokens(request)
        self._check_tokens(tokens, request.max_tokens)
        return tokens

    def _prompt_tokens(self, request: Request) -> list[int]:
        tok = self.tokenizer
        if request.messages is not None:
            return self._render_chat(request)
        if isinstance(request.prompt, str):
            # Like mlx_lm.generate: add BOS unless the text already starts with it.
            add_special = tok.bos_token is None or not request.prompt.startswith(tok.bos_token)
            return list(tok.encode(request.prompt, add_special_tokens=add_special))
        return list(request.prompt or [])

    def _render_chat(self, request: Request) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise JobInputError(
                f"model {self.info.name} has no chat template, so `messages` cannot be "
                "rendered: send `prompt` (text you formatted yourself, or token ids) instead"
            )
        messages = [{"role": m.role, "content": m.content} for m in request.messages or []]
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:
            raise JobInputError(
                f"the chat template of {self.info.name} rejected these messages "
                f"({_error_line(exc)}): check the roles and their order"
            ) from exc
        return list(out["input_ids"] if isinstance(out, dict) else out)

    def _check_tokens(self, tokens: list[int], max_tokens: int) -> None:
        vocab, ctx = self.info.vocab_size, self.info.context_length
        if not tokens:
            raise JobInputError("the prompt encodes to no tokens: send non-empty text")
        for i, t in enumerate(tokens):
            if not 0 <= t < vocab:
                raise JobInputError(
                    f"prompt token id {t} at position {i} is outside the vocabulary of "
                    f"{self.info.name} (ids 0 to {vocab - 1}): tokenize with this model's "
                    "tokenizer"
                )
        n = len(tokens)
        if n + max_tokens > ctx:
            fix = (
                f"shorten the prompt to at most {ctx - max_tokens} tokens or lower "
                f"max_tokens to at most {ctx - n}"
                if n < ctx
                else f"shorten the prompt to under {ctx} tokens"
            )
            raise JobInputError(
                f"the prompt is {n} tokens and max_tokens is {max_tokens}, together "
                f"{n + max_tokens}, but the context of {self.info.name} is {ctx} tokens: {fix}"
            )

    # -- running --

    def add(self, job: EngineJob, tokens: list[int] | None = None) -> Completion | None:
        """Admit a job into the running batch; an "error" Completion if it cannot run.

        ``tokens`` are the prompt's ids from :meth:`encode`, if already computed.
        Raises ``ValueError`` if a job with the same key is already running.
        """
        if job.key in self._uids:
            raise ValueError(f"job {job.key} is already in the engine")
        now = time.time()
        try:
            tokens = self._prompt_tokens(job.request) if tokens is None else list(tokens)
            self._check_tokens(tokens, job.request.max_tokens)
        except JobInputError as exc:
            return Completion(job.key, "error", error=str(exc), admitted_at=now, finished_at=now)
        detokenizer = self.tokenizer.detokenizer if job.request.stop else None
        run = _Run(job, tokens, detokenizer, now)
        run.logprobs = None if job.request.logprobs is None else []
        try:
            self._insert(run)
        except Exception as exc:
            return run.completion("error", "", f"could not start the job: {_error_line(exc)}")
        return None

    def _insert(self, run: _Run) -> None:
        req = run.job.request
        penalty = req.repetition_penalty
        processors = [] if penalty is None else make_logits_processors(repetition_penalty=penalty)
        sampler = make_job_sampler(req, self.info.vocab_size)
        (uid,) = self._gen.insert(
            [run.prompt], [req.max_tokens], samplers=[sampler], logits_processors=[processors]
        )
        self._runs[uid] = run
        self._uids[run.job.key] = uid

    def step(self) -> list[Completion]:
        """One ``BatchGenerator.next()``: a decode step and/or a prefill chunk.

        Returns the jobs that finished in this step.
        """
        if not self._runs:
            return []
        try:
            _, responses = self._gen.next()
        except Exception as exc:
            return self._fail_batch(exc)
        now = time.time()
        logprobs = self._logprobs(responses)
        done = []
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
        return done

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
        # Like mlx_lm.batch_generate: decode the ids (keeps a leading space, unlike the
        # streaming detokenizers).
        return run.completion(reason, self.tokenizer.decode(run.tokens), error)

    def _fail_batch(self, exc: Exception) -> list[Completion]:
        """Fail the jobs the model was working on; keep the waiting ones on a new generator."""
        waiting = {seq[0] for seq in getattr(self._gen, "_unprocessed_sequences", ())}
        error = f"generation failed for the whole batch: {_error_line(exc)}"
        failed = [
            self._finish(uid, "error", error) for uid in list(self._runs) if uid not in waiting
        ]
        old, self._gen = self._gen, self._new_generator()
        with contextlib.suppress(Exception):  # the old generator is broken anyway
            old.close()
        mx.clear_cache()
        for uid in sorted(waiting & self._runs.keys()):
            run = self._runs.pop(uid)
            del self._uids[run.job.key]
            try:
                self._insert(run)
            except Exception as insert_exc:
                failed.append(run.completion("error", "", _error_line(insert_exc)))
        return failed

    def cancel(self, key: str) -> Completion | None:
        """Remove a job from the batch at once: a "cancelled" Completion, or None if unknown."""
        uid = self._uids.get(key)
        if uid is None:
            return None
        self._gen.remove([uid])
        return self._finish(uid, "cancelled")

    def warmup(self) -> None:
        """Run one tiny generation so that the first real jobs skip compile/alloc costs."""
        if self._runs:
            return
        failed = self.add(EngineJob(WARMUP_KEY, Request(prompt="Hello, world", max_tokens=4)))
        if failed is not None:
            raise RuntimeError(f"warmup failed: {failed.error}")
        while self._runs:
            self.step()

    def close(self) -> None:
        """Drop all jobs and release the generator."""
        self._runs.clear()
        self._uids.clear()
        self._gen.close()
