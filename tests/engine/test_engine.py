"""BatchGeneratorEngine: continuous batching over mlx-lm's BatchGenerator, against mlx-lm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_reference import REQUESTS, FlakyModel, check_against_reference, reference, run_all
from mlx_lm.utils import load_tokenizer

from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine, EngineJob, JobInputError
from mlxq.wire import Message, Request


@pytest.fixture
def engine(tiny) -> BatchGeneratorEngine:
    model, tokenizer = tiny
    return BatchGeneratorEngine.from_loaded(model, tokenizer, "tiny")


def test_batched_greedy_equals_single_requests(tiny, engine: BatchGeneratorEngine) -> None:
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)})
    check_against_reference(tiny, engine, done)
    assert len({tuple(c.token_ids) for c in done.values()}) == len(REQUESTS)
    # The first token of request 0 starts with a space: kept, as tokenizer.decode does
    # (mlx-lm's streaming detokenizer would drop it).
    assert done["0"].text.startswith(" ")
    assert engine.active == 0


@pytest.mark.parametrize(
    ("max_batch", "prefill_batch", "prefill_step", "join_every"),
    [(32, 8, 2048, 3), (4, 2, 7, 2), (2, 1, 16, 1)],
)
def test_jobs_joining_mid_run_equal_single_requests(
    tiny, max_batch: int, prefill_batch: int, prefill_step: int, join_every: int
) -> None:
    model, tokenizer = tiny
    engine = BatchGeneratorEngine.from_loaded(
        model,
        tokenizer,
        "tiny",
        max_batch=max_batch,
        prefill_batch=prefill_batch,
        prefill_step=prefill_step,
    )
    done = run_all(engine, {str(i): r for i, r in enumerate(REQUESTS)}, join_every)
    check_against_reference(tiny, engine, done)


def test_engine_loads_a_folder(tiny_model_dir: Path, tiny) -> None:
    engine = BatchGeneratorEngine(str(tiny_model_dir), max_batch=4)
    assert engine.info.name == str(tiny_model_dir)
    done = run_all(engine, {"0": REQUESTS[0]})
    model, tokenizer = tiny
    ref = reference(model, tokenizer, engine.encode(REQUESTS[0]), REQUESTS[0])
    assert done["0"].token_ids == ref["tokens"]
    engine.close()


def test_model_info(engine: BatchGeneratorEngine) -> None:
    info = engine.info
    assert (info.model_type, info.num_layers, info.hidden_size) == ("llama", 2, 64)
    assert (info.num_kv_heads, info.head_dim, info.vocab_size) == (2, 16, 512)
    assert info.context_length == 2048 and info.dtype == "float32"
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    params = 512 * 64 * 2 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64
    assert info.param_bytes == params * 4


def test_encode(engine: BatchGeneratorEngine) -> None:
    tokenizer = engine.tokenizer
    text = engine.encode(Request(prompt="The capital"))
    assert text == tokenizer.encode("The capital") and text.count(tokenizer.bos_token_id) == 1
    assert engine.encode(Request(prompt="<|begin_of_text|>The capital")) == text
    assert engine.encode(Request(prompt=[3, 4, 5])) == [3, 4, 5]
    chat = engine.encode(Request(messages=[Message("user", "Hi")]))
    messages = [{"role": "user", "content": "Hi"}]
    assert chat == tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_stop_strings_truncate_text(engine: BatchGeneratorEngine) -> None:
    request = Request(prompt="The capital of France is", max_tokens=20)
    full = run_all(engine, {"full": request})["full"]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    text = full.text
    stop = text[9:12]  # robust to tokenization: may start or end inside a token
    first = text.find(stop)
    jobs = {
        "one": Request(prompt=request.prompt, max_tokens=20, stop=[stop]),
        "two": Request(prompt=request.prompt, max_tokens=20, stop=["never there", text[14:16]]),
        "miss": Request(prompt=request.prompt, max_tokens=20, stop=["never there"]),
        "other": Request(prompt="Once upon a time", max_tokens=20),
    }
    with engine._gen.stats() as stats:
        done = run_all(engine, jobs)
    # Stopped jobs leave the batch at once: one decode per token kept, no more.
    assert stats.generation_tokens == sum(len(c.token_ids) for c in done.values())
    assert done["one"].finish_reason == "stop" and done["one"].text == text[:first]
    assert full.token_ids[: len(done["one"].token_ids)] == done["one"].token_ids
    assert len(done["one"].token_ids) < 20  # removed from the batch early
    assert done["two"].text == text[: text.find(text[14:16])]
    assert done["miss"].finish_reason == "length" and done["miss"].text == text
    assert done["other"].finish_reason == "length" and len(done["other"].token_ids) == 20


def test_eos_ends_a_job_and_is_not_output(tiny, tiny_model_dir: Path) -> None:
    model, tokenizer = tiny
    request = Request(prompt="The capital of France is", max_tokens=20)
    ref = reference(model, tokenizer, tokenizer.encode(request.prompt), request)["tokens"]
    eos = ref[5]
    cut = ref.index(eos)
    eos_tokenizer = load_tokenizer(tiny_model_dir, eos_token_ids=[eos])
    engine = BatchGeneratorEngine.from_loaded(model, eos_tokenizer, "tiny")
    done = run_all(engine, {"a": request, "b": Request(prompt=[7, 8, 9], max_tokens=5)})
    assert done["a"].finish_reason == "stop"
    assert done["a"].token_ids == ref[:cut]
    assert eos not in done["a"].token_ids


def test_max_tokens_gives_length(engine: BatchGeneratorEngine) -> None:
    done = run_all(engine, {"a": Request(prompt=[1, 2, 3], max_tokens=1)})
    assert done["a"].finish_reason == "length" and len(done["a"].token_ids) == 1


def test_seeded_sampling_is_reproducible_across_batches(tiny) -> None:
    model, tokenizer = tiny

    def sampled(seed: int, **kw: Any) -> Request:
        return Request(prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed, **kw)

    alone = run_all(BatchGeneratorEngine.from_loaded(model, tokenizer, "t"), {"s": sampled(7)})["s"]
    crowd = {
        "g": Request(prompt="The capital of France is", max_tokens=20),
        "x": sampled(8),
        "u": Request(prompt=[4, 5, 6], max_tokens=10, temperature=0.7),
        "s": sampled(7),
        "y": sampled(7, top_p=0.9, top_k=50, min_p=0.05),
    }
    engine = BatchGeneratorEngine.from_loaded(model, tokenizer, "t", max_batch=3, prefill_step=3)
    mixed = run_all(engine, crowd, join_every=2)
    assert mixed["s"].token_ids == alone.token_ids
    assert mixed["x"].token_ids != alone.token_ids  # the seed matters
    greedy = reference(model, tokenizer, tokenizer.encode("Once upon a time"), sampled(7))
    assert alone.token_ids != greedy["tokens"]  # it really sampled
    again = run_all(BatchGeneratorEngine.from_loaded(model, tokenizer, "t"), {"y": crowd["y"]})
    assert again["y"].token_ids == mixed["y"].token_ids


def test_logprobs(tiny, engine: BatchGeneratorEngine) -> None:
    model, tokenizer = tiny
    jobs = {
        "three": Request(prompt="The capital of France is", max_tokens=8, logprobs=3),
        "zero": Request(prompt="Once upon a time", max_tokens=8, logprobs=0),
        "none": Request(prompt="def hello(name):", max_tokens=8),
    }
    done = run_all(engine, jobs)
    assert done["none"].logprobs is None
    assert [t.top for t in done["zero"].logprobs] == [[]] * 8
    ref = reference(model, tokenizer, engine.encode(jobs["three"]), jobs["three"])
    lps = done["three"].logprobs
    assert [t.token_id for t in lps] == done["three"].token_ids == ref["tokens"]
    for token_lp, ref_lp in zip(lps, ref["logprobs"], strict=True):
        assert len(token_lp.top) == 3
        assert token_lp.top[0].token_id == token_lp.token_id  # greedy picks the best
        values = [t.logprob for t in token_lp.top]
        assert values == sorted(values, reverse=True)
        assert token_lp.logprob == pytest.approx(ref_lp[token_lp.token_id].item(), abs=1e-4)
        best = mx.argsort(-ref_lp)[:3].tolist()
        assert [t.token_id for t in token_lp.top] == best


def test_repetition_penalty_matches_mlx_lm(tiny, engine: BatchGeneratorEngine) -> None:
    model, tokenizer = tiny
    request = Request(prompt="Once upon a time", max_tokens=24, repetition_penalty=1.8)
    done = run_all(engine, {"p": request, "g": Request(prompt=[9, 9], max_tokens=20)})
    ref = reference(model, tokenizer, engine.encode(request), request)["tokens"]
    plain = reference(model, tokenizer, engine.encode(request), Request(prompt="x", max_tokens=24))
    assert done["p"].token_ids == ref
    assert ref != plain["tokens"]


def test_bad_requests_fail_alone(tiny, engine: BatchGeneratorEngine) -> None:
    jobs = {str(i): r for i, r in enumerate(REQUESTS)}
    jobs["bad-id"] = Request(prompt=[5, 99999, 6])
    jobs["too-long"] = Request(prompt=[5] * 2040, max_tokens=16)
    done = run_all(engine, jobs, join_every=1)
    bad = done["bad-id"]
    assert bad.finish_reason == "error" and "99999" in bad.error and "0 to 511" in bad.error
    long = done["too-long"]
    assert long.finish_reason == "error"
    assert all(n in long.error for n in ("2040", "16", "2048", "2032"))
    check_against_reference(tiny, engine, done)
    with pytest.raises(JobInputError, match="max_tokens"):
        engine.encode(Request(prompt=[1], max_tokens=5000))


def test_messages_without_chat_template(tiny, tiny_model_dir: Path) -> None:
    model, _ = tiny
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.has_chat_template = False
    engine = BatchGeneratorEngine.from_loaded(model, tokenizer, "plain")
    failed = engine.add(EngineJob("m", Request(messages=[Message("user", "hi")])))
    assert failed is not None and failed.finish_reason == "error"
    assert "chat template" in failed.error and "prompt" in failed.error
    assert engine.active == 0


def test_insert_exception_fails_alone(
    engine: BatchGeneratorEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.add(EngineJob("ok", Request(prompt=[1, 2, 3], max_tokens=4)))
    real_insert = engine._gen.insert_segments

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cache exploded")

    monkeypatch.setattr(engine._gen, "insert_segments", broken)
    failed = engine.add(EngineJob("bad", Request(prompt=[1, 2, 3], max_tokens=4)))
    assert failed is not None and "cache exploded" in failed.error
    monkeypatch.setattr(engine._gen, "insert_segments", real_insert)
    done = run_all(engine, {})
    assert done["ok"].finish_reason == "length" and engine.active == 0


def test_duplicate_key_is_refused(engine: BatchGeneratorEngine) -> None:
    engine.add(EngineJob("k", Request(prompt=[1, 2])))
    with pytest.raises(ValueError, match="already"):
        engine.add(EngineJob("k", Request(prompt=[1, 2])))
    engine.step()  # k joins the batch: still refused
    with pytest.raises(ValueError, match="already"):
        engine.add(EngineJob("k", Request(prompt=[1, 2])))
    engine.add(EngineJob("w", Request(prompt=[1, 2])))
    assert engine.cancel("w") is not None and engine.cancel("k") is not None
    # a key whose job was cancelled, waiting or decoding, can come back (a retry)
    engine.add(EngineJob("w", Request(prompt=[1, 2], max_tokens=2)))
    engine.add(EngineJob("k", Request(prompt=[1, 2], max_tokens=2)))
    done = {}
    while engine.active:
        done.update((c.key, c) for c in engine.step())
    assert set(done) == {"w", "k"}
    engine.add(EngineJob("k", Request(prompt=[1, 2])))  # and once it finished


def test_cancel(tiny, engine: BatchGeneratorEngine) -> None:
    model, tokenizer = tiny
    engine.add(EngineJob("a", REQUESTS[0]))
    engine.add(EngineJob("b", REQUESTS[2]))
    for _ in range(5):
        engine.step()
    engine.add(EngineJob("waiting", Request(prompt=[1, 2, 3])))
    cancelled = engine.cancel("a")
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    ref_a = reference(model, tokenizer, engine.encode(REQUESTS[0]), REQUESTS[0])["tokens"]
    assert 0 < len(cancelled.token_ids) < len(ref_a)
    assert cancelled.token_ids == ref_a[: len(cancelled.token_ids)]
    waiting = engine.cancel("waiting")
    assert waiting is not None and waiting.token_ids == [] and waiting.first_token_at is None
    assert engine.cancel("a") is None and engine.cancel("nope") is None
    b_so_far = len(engine._runs[engine._uids["b"]].tokens)
    with engine._gen.stats() as stats:
        done = run_all(engine, {})
    assert list(done) == ["b"]
    assert stats.generation_tokens == len(done["b"].token_ids) - b_so_far  # "a" stopped
    ref_b = reference(model, tokenizer, [5, 6, 7], REQUESTS[2])["tokens"]
    assert done["b"].token_ids == ref_b


def test_cancel_during_prefill(tiny) -> None:
    model, tokenizer = tiny
    engine = BatchGeneratorEngine.from_loaded(
        model, tokenizer, "tiny", prefill_batch=2, prefill_step=8
    )
    engine.add(EngineJob("long", REQUESTS[3]))  # 80 prompt tokens: ten prefill chunks
    engine.add(EngineJob("short", REQUESTS[2]))
    for _ in range(3):
        assert engine.step() == []
    cancelled = engine.cancel("long")
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    assert cancelled.token_ids == [] and cancelled.prompt_tokens == 80
    done = run_all(engine, {"late": REQUESTS[0]})
    for key, request in (("short", REQUESTS[2]), ("late", REQUESTS[0])):
        ref = reference(model, tokenizer, engine.encode(request), request)["tokens"]
        assert done[key].token_ids == ref


def test_model_error_fails_the_batch_and_engine_recovers(tiny) -> None:
    model, tokenizer = tiny
    flaky = FlakyModel(model)
    engine = BatchGeneratorEngine.from_loaded(
        flaky, tokenizer, "tiny", max_batch=2, prefill_batch=2
    )
    for i in range(3):
        engine.add(EngineJob(str(i), REQUESTS[i]))
    engine.step()
    engine.step()
    flaky.fail = True
    failed = engine.step()
    flaky.fail = False
    assert sorted(c.key for c in failed) == ["0", "1"]
    for c in failed:
        assert c.finish_reason == "error" and "out of memory" in c.error
        assert "\n" not in c.error
    assert engine.active == 1  # the job waiting for a slot was kept
    done = run_all(engine, {"3": REQUESTS[3]})
    for key in ("2", "3"):
        request = REQUESTS[int(key)]
        ref = reference(model, tokenizer, engine.encode(request), request)["tokens"]
        assert done[key].token_ids == ref


def test_timing_fields(engine: BatchGeneratorEngine) -> None:
    done = run_all(engine, {"a": Request(prompt=[1, 2, 3], max_tokens=5)})["a"]
    assert done.admitted_at <= done.first_token_at <= done.finished_at
    assert done.prefill_seconds == pytest.approx(done.first_token_at - done.admitted_at)
    assert done.decode_seconds is not None and done.decode_seconds >= 0


def test_warmup_leaves_nothing_behind(engine: BatchGeneratorEngine) -> None:
    engine.warmup()
    assert engine.active == 0
    done = run_all(engine, {"a": Request(prompt=[1, 2, 3], max_tokens=3)})
    assert len(done["a"].token_ids) == 3
    assert engine.step() == []


def test_stats_count_prompt_and_generated_tokens(engine: BatchGeneratorEngine) -> None:
    jobs = {"a": Request(prompt=[1, 2, 3, 4], max_tokens=5), "b": REQUESTS[3]}
    done = run_all(engine, jobs)
    stats = engine.stats()
    assert stats.prompt_tokens == 4 + 80
    assert stats.prefilled_tokens == 3 + 79  # the last prompt token starts the decode
    assert stats.generated_tokens == sum(len(c.token_ids) for c in done.values())
    assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
    assert (stats.prefix_hits, stats.reused_tokens, stats.prefix_cache_bytes) == (0, 0, 0)


class SlidingWindowModel(FlakyModel):
    """A model whose cache is a sliding window: prefixes cannot be cut out of it."""

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import RotatingKVCache

        return [RotatingKVCache(max_size=4096) for _ in self.inner.layers]


def test_prefix_cache_needs_plain_kv_caches(tiny, caplog: pytest.LogCaptureFixture) -> None:
    model, tokenizer = tiny
    engine = BatchGeneratorEngine.from_loaded(
        SlidingWindowModel(model), tokenizer, "sliding", prefix_cache_bytes=1 << 20
    )
    assert "prefix cache off" in caplog.text
    prompt = list(range(3, 300))
    done = run_all(engine, {"a": Request(prompt=prompt), "b": Request(prompt=prompt)})
    assert done["a"].token_ids == done["b"].token_ids
    assert engine.stats().prefix_hits == 0
