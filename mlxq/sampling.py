"""Per-job sampling pieces of the engine: samplers, stop strings, logprobs.

Samplers follow ``mlx_lm.sample_utils.make_sampler`` (the same top-p, min-p and top-k
filters, then categorical sampling at the temperature; greedy at temperature 0). A
request with a ``seed`` gets a sampler that owns its random key and splits it once per
token, so its samples do not depend on the other jobs in the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler

from mlxq.types import Request, TokenLogprob, TopLogprob

Sampler = Callable[[mx.array], mx.array]
Filter = Callable[[mx.array], mx.array]


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


def make_job_sampler(request: Request, vocab_size: int) -> Sampler:
    """The sampler of one job: greedy, or filtered categorical (seeded if asked)."""
    if request.temperature == 0:
        return greedy_sampler  # one shared object: mlx-lm then samples the batch at once
    filters = _filters(request, vocab_size)
    inv_temp = 1.0 / request.temperature
    key = None if request.seed is None else mx.random.key(request.seed)

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
            pairs = sorted(row, key=lambda p: (-p[1], p[0]))[: ns[i]]
        out.append(TokenLogprob(token, value, [TopLogprob(t, v) for t, v in pairs]))
    return out
