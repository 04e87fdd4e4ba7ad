"""Engine tests' shared parts: requests, mlx-lm's single-request reference, a runner that
admits jobs as it steps, and a model that fails on demand."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine, Completion, EngineJob
from mlxq.wire import Message, Request

REQUESTS = [
    Request(prompt="The capital of France is", max_tokens=20),
    Request(prompt="Once upon a time there was a little town by the sea, where people worked"),
    Request(prompt=[5, 6, 7], max_tokens=24),
    Request(prompt=list(range(10, 90)), max_tokens=12),
    Request(messages=[Message("system", "Be brief."), Message("user", "Capital of France?")]),
    Request(prompt="def hello(name):", max_tokens=30),
]
for _r in REQUESTS[1::3]:
    _r.max_tokens = 16


def random_requests(
    count: int, seed: int, prompt: tuple[int, int], tokens: tuple[int, int], vocab: int = 250
) -> dict[str, Request]:
    """``count`` jobs ``j0..``: prompts of random tokens (``prompt``: the range of their
    lengths) and ``max_tokens`` in the range ``tokens``, so outputs end at varied lengths."""
    rng = random.Random(seed)
    return {
        f"j{i}": Request(
            prompt=[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))],
            max_tokens=rng.randint(*tokens),
        )
        for i in range(count)
    }


def reference(model, tokenizer, tokens: list[int], request: Request) -> dict[str, Any]:
    """mlx-lm's single-request greedy generation: tokens (EOS excluded), logprobs, text."""
    processors = None
    if request.repetition_penalty is not None:
        processors = make_logits_processors(repetition_penalty=request.repetition_penalty)
    out, logprobs = [], []
    steps = generate_step(
        mx.array(tokens), model, max_tokens=request.max_tokens, logits_processors=processors
    )
    for token, lp in steps:
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
        logprobs.append(lp)
    # Like mlx_lm.batch_generate, the text is the decode of the ids, less a character cut in
    # half at the end (mlx-lm keeps its U+FFFD; mlxq drops it, as its streamed chunks do).
    text = tokenizer.decode(out).rstrip("\ufffd")
    return {"tokens": out, "logprobs": logprobs, "text": text}


def run_all(
    engine: BatchGeneratorEngine, jobs: dict[str, Request], join_every: int = 0
) -> dict[str, Completion]:
    """Run jobs to completion; with ``join_every``, admit one job every that many steps."""
    pending = list(jobs.items())
    done: dict[str, Completion] = {}
    steps = 0
    while pending or engine.active:
        while pending and (not join_every or steps % join_every == 0 or not engine.active):
            key, request = pending.pop(0)
            failed = engine.add(EngineJob(key, request))
            if failed is not None:
                done[key] = failed
            if join_every:
                break
        for c in engine.step():
            done[c.key] = c
        steps += 1
    return done


def check_against_reference(
    tiny, engine: BatchGeneratorEngine, done: dict[str, Completion]
) -> None:
    """Each of REQUESTS (job keys "0", "1", ...) equals mlx-lm's greedy reference."""
    model, tokenizer = tiny
    for i, request in enumerate(REQUESTS):
        tokens = engine.encode(request)
        ref = reference(model, tokenizer, tokens, request)
        c = done[str(i)]
        assert c.token_ids == ref["tokens"], f"request {i}"
        assert c.text == ref["text"]
        assert c.prompt_tokens == len(tokens)
        expected = "length" if len(ref["tokens"]) == request.max_tokens else "stop"
        assert c.finish_reason == expected


class FlakyModel:
    """Delegates to a model but raises while ``fail`` is set, like running out of memory."""

    def __init__(self, model: Any) -> None:
        self.inner = model
        self.fail = False
        self.error = "[metal::malloc] Attempting to allocate 99 GB\nwhich is too much"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail:
            raise RuntimeError(self.error)
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def record_block_widths(monkeypatch: Any, streams: list[str] | None = None) -> list[int]:
    """The query rows of each chunk that reaches a prefill's blocked attention
    (:class:`~mlxq.engine.slots.causal_blocks.BlockedCache`), from now on in this test;
    with ``streams``, the CPU stream each was built on is appended there."""
    from mlxq.engine.slots.causal_blocks import BlockedCache

    widths: list[int] = []
    attend = BlockedCache.attend

    def spy(self: BlockedCache, queries: mx.array, *args: Any) -> mx.array:
        widths.append(queries.shape[2])
        if streams is not None:
            streams.append(str(mx.default_stream(mx.cpu)))
        return attend(self, queries, *args)

    monkeypatch.setattr(BlockedCache, "attend", spy)
    return widths
