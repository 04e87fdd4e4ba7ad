"""A decode step's sampling (``mlxq.engine.slots.step.sample``) picks mlx-lm's tokens."""

from __future__ import annotations

import mlx.core as mx


def test_greedy_steps_pick_mlx_lm_s_token_at_every_width() -> None:
    """A greedy step whose rows keep no logprobs skips the logsumexp at float32 only: its
    argmax is mlx-lm's (the logprobs') there, while at bfloat16 the subtraction's rounding
    ties near-equal logits, and mlx-lm's argmax takes the first of them."""
    from types import SimpleNamespace

    from mlx_lm.sample_utils import greedy_sampler

    from mlxq.engine.slots.step import Row, sample

    mx.random.seed(3)
    run = SimpleNamespace(job=SimpleNamespace(key="k"), logprobs=None)
    rows = [Row(run, slot, greedy_sampler, [], 0) for slot in range(512)]  # type: ignore[arg-type]
    logits = mx.random.normal((512, 512)) * 0.05  # (near-equal logits: ties at 16 bits)
    for dtype in (mx.float32, mx.bfloat16):
        x = logits.astype(dtype)
        mlx_lm_pick = greedy_sampler(x - mx.logsumexp(x, axis=-1, keepdims=True))
        assert sample(rows, x, [])[0].tolist() == mlx_lm_pick.tolist(), dtype
    x = logits.astype(mx.bfloat16)
    assert greedy_sampler(x).tolist() != sample(rows, x, [])[0].tolist()  # (the case it avoids)
