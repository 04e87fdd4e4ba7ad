"""The CUDA decode attention that reads only unmasked positions
(:mod:`mlxq.engine.slots.ragged_attention`) against a float32 reference: prefix masks
(as decoding makes them) and any other pattern, several head sizes and query groups,
slices of a larger cache, and inside ``mx.compile`` as the compiled forward runs it.
The kernel's tests need CUDA (the lent GPU runs them: bench/README.md); elsewhere the
engine never picks it. A group of query heads too wide for a block falls back anywhere."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxq.engine.slots import ragged_attention
from mlxq.engine.slots.attention import gqa_decode, ragged_or_gqa
from mlxq.engine.slots.ragged_attention import ragged_decode

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="a CUDA kernel")


def reference(q, k, v, scale, mask):
    group = q.shape[1] // k.shape[1]
    k32 = mx.repeat(k.astype(mx.float32), group, axis=1)
    v32 = mx.repeat(v.astype(mx.float32), group, axis=1)
    scores = (q.astype(mx.float32) * scale) @ k32.swapaxes(-1, -2)
    scores = mx.where(mask, scores, -1e30)
    return mx.softmax(scores, axis=-1) @ v32


@cuda
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(32, 8, 64), (8, 8, 128), (12, 2, 64)])
@pytest.mark.parametrize("pattern", ["prefix", "scattered"])
def test_matches_a_float32_reference(q_heads: int, kv_heads: int, dim: int, pattern: str) -> None:
    rows, span = 37, 300
    q = mx.random.normal((rows, q_heads, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((rows, kv_heads, span, dim)).astype(mx.bfloat16)
    v = mx.random.normal((rows, kv_heads, span, dim)).astype(mx.bfloat16)
    if pattern == "prefix":
        lengths = mx.random.randint(1, span + 1, (rows,))
        mask = (mx.arange(span)[None] < lengths[:, None])[:, None, None, :]
    else:
        mask = (mx.random.uniform(shape=(rows, 1, 1, span)) < 0.3) | (mx.arange(span) == 0)
    got = ragged_decode(q, k, v, dim**-0.5, mask).astype(mx.float32)
    want = reference(q, k, v, dim**-0.5, mask)
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 2e-2


@cuda
def test_slices_of_a_cache_and_the_compiled_forward() -> None:
    """A group's rows and span sliced from a larger cache (no copy asked), and the kernel
    traced by ``mx.compile`` with the cache as state, give the reference's output."""
    rows, span, dim = 64, 256, 64
    q = mx.random.normal((rows, 32, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((rows + 8, 8, span + 64, dim)).astype(mx.bfloat16)
    v = mx.random.normal((rows + 8, 8, span + 64, dim)).astype(mx.bfloat16)
    lengths = mx.random.randint(1, span + 1, (rows,))
    mask = (mx.arange(span)[None] < lengths[:, None])[:, None, None, :]
    ks, vs = k[4 : rows + 4, :, :span], v[4 : rows + 4, :, :span]
    want = reference(q, ks, vs, 0.125, mask)
    assert mx.abs(ragged_decode(q, ks, vs, 0.125, mask) - want).max().item() < 2e-2
    compiled = mx.compile(lambda a, b, c, m: ragged_decode(a, b, c, 0.125, m))
    assert mx.abs(compiled(q, ks, vs, mask) - want).max().item() < 2e-2


@cuda
def test_supported_needs_cuda_and_heads_of_64s() -> None:
    assert ragged_attention.supported(64) and ragged_attention.supported(128)
    assert not ragged_attention.supported(48) and not ragged_attention.supported(96)


def test_a_group_too_wide_for_a_block_attends_with_gqa(caplog: pytest.LogCaptureFixture) -> None:
    assert ragged_attention.fits(4, 64) and ragged_attention.fits(8, 128)
    assert not ragged_attention.fits(16, 128) and not ragged_attention.fits(32, 128)
    q = mx.random.normal((3, 32, 1, 128))
    k, v = mx.random.normal((3, 1, 20, 128)), mx.random.normal((3, 1, 20, 128))
    mask = (mx.arange(20)[None] < mx.array([[5], [20], [1]]))[:, None, None, :]
    with caplog.at_level("WARNING", logger="mlxq.engine.slots.engine"):
        got = ragged_or_gqa(q, k, v, 128**-0.5, mask)
    assert mx.allclose(got, gqa_decode(q, k, v, 128**-0.5, mask)).item()
    assert "cannot hold 32 query heads of 128 values" in caplog.text


@cuda
def test_the_engine_with_cuda_defaults_equals_mlx_lm_greedy(tmp_path) -> None:
    """The slot engine as CUDA runs it (compiled forward, ragged attention, bucketed
    prefill, overlapped steps) gives mlx-lm's single-request greedy tokens, jobs joining
    mid-run, on a model whose heads the kernel takes (float32: its generic loads)."""
    import mlx_lm
    from engine_reference import REQUESTS, check_against_reference, run_all

    from mlxq.engine.models.make import make_model
    from mlxq.engine.slots.engine import SlotEngine

    model, tokenizer = mlx_lm.load(str(make_model(tmp_path / "m", "cpu-small")))
    engine = SlotEngine.from_loaded(model, tokenizer, "m", max_batch=4, prefill_batch=2)
    assert engine.choices.attention == "ragged" and engine.choices.compiled
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, 2)
    check_against_reference((model, tokenizer), engine, done)
