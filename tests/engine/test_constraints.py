"""Structured outputs: response_format checked at submit, enforced in the batch by llguidance."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jsonschema
import lark
import llguidance
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlxq.engine.constraints.batch import ConstraintBatch, Grammars, make_lltokenizer
from mlxq.engine.constraints.grammar import grammar_of
from mlxq.engine.constraints.slot_hook import ConstraintHook
from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine, Completion, EngineJob
from mlxq.wire import (
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    Message,
    RegexFormat,
    Request,
)
from tests.helpers import run_mlxq

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8}-[0-9]{3}"
LARK = """
start: list
list: "[" item ("," item)* "]"
item: NUMBER | list
NUMBER: /[0-9]{1,3}/
"""
SCHEMA = JsonSchemaFormat(JsonSchemaSpec(schema=PERSON, name="person", strict=True))


def stopped_outputs_conform(request: Request, c: Completion) -> None:
    """A job that stopped (its grammar completed) produced text its constraint accepts."""
    fmt = request.response_format
    if isinstance(fmt, JsonSchemaFormat):
        jsonschema.validate(json.loads(c.text), fmt.json_schema.schema)
    elif isinstance(fmt, JsonObjectFormat):
        assert isinstance(json.loads(c.text), dict)
    elif isinstance(fmt, RegexFormat):
        assert re.fullmatch(fmt.pattern, c.text), c.text
    elif isinstance(fmt, GrammarFormat):
        lark.Lark(fmt.lark).parse(c.text)


def constrained_reference(tiny, tokens: list[int], request: Request) -> list[int]:
    """mlx-lm's single-request greedy, masked by a matcher stepped one token at a time."""
    model, tokenizer = tiny
    lltok = make_lltokenizer(tokenizer, model.args.vocab_size)
    matcher = llguidance.LLMatcher(lltok, grammar_of(request.response_format))
    started = False

    def mask(context: mx.array, logits: mx.array) -> mx.array:
        nonlocal started
        if started:
            assert matcher.consume_token(context[-1].item())
        started = True
        bias = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)
        allowed = mx.array(bias[: logits.shape[-1]] > 0)
        return mx.where(allowed, logits, -mx.inf)

    out = []
    steps = generate_step(
        mx.array(tokens), model, max_tokens=request.max_tokens, logits_processors=[mask]
    )
    for token, _ in steps:
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


def run_jobs(
    engine: BatchGeneratorEngine, jobs: dict[str, Request], join_every: int = 0
) -> dict[str, Any]:
    pending, done, steps = list(jobs.items()), {}, 0
    while pending or engine.active:
        while pending and (not join_every or steps % join_every == 0 or not engine.active):
            key, request = pending.pop(0)
            if (failed := engine.add(EngineJob(key, request))) is not None:
                done[key] = failed
            if join_every:
                break
        done.update((c.key, c) for c in engine.step())
        steps += 1
    return done


@pytest.fixture
def engine(tiny) -> BatchGeneratorEngine:
    return BatchGeneratorEngine.from_loaded(*tiny, "tiny", max_batch=8)


# -- at submit ----------------------------------------------------------------------------


# -- in the batch -------------------------------------------------------------------------


def test_mixed_batch_free_rows_stay_greedy_and_constrained_rows_conform(tiny, engine):
    from engine_reference import reference

    model, tokenizer = tiny
    free = {
        "free-0": Request(prompt="The capital of France is", max_tokens=20),
        "free-1": Request(prompt=[5, 6, 7], max_tokens=24),
        "free-2": Request(messages=[Message("user", "Capital of France?")], max_tokens=16),
    }
    constrained = {
        "json-greedy": Request(prompt="A person:", max_tokens=120, response_format=SCHEMA),
        "json-sampled": Request(
            prompt="A person:", max_tokens=120, response_format=SCHEMA, temperature=1, seed=1
        ),
        "regex": Request(prompt="An id:", max_tokens=40, response_format=RegexFormat(REGEX)),
        "lark": Request(
            prompt="A list:", max_tokens=60, response_format=GrammarFormat(LARK), temperature=0.7
        ),
        "object": Request(
            messages=[Message("user", "JSON please")],
            max_tokens=60,
            response_format=JsonObjectFormat(),
        ),
    }
    jobs = {**free, **constrained}
    order = ["free-0", "json-greedy", "regex", "free-1", "json-sampled", "lark", "free-2"]
    done = run_jobs(engine, {k: jobs[k] for k in [*order, "object"]}, join_every=3)

    for key, request in free.items():
        ref = reference(model, tokenizer, engine.encode(request), request)
        assert done[key].token_ids == ref["tokens"], key
    for key in ("json-greedy", "json-sampled", "regex", "lark"):
        assert done[key].finish_reason == "stop", (key, done[key].text)
    for key, request in constrained.items():
        c = done[key]
        assert c.error is None, c.error
        if c.finish_reason == "stop":
            stopped_outputs_conform(request, c)
    for key in ("json-greedy", "regex"):
        tokens = engine.encode(jobs[key])
        assert done[key].token_ids == constrained_reference(tiny, tokens, jobs[key]), key


def test_bounded_schemas_always_finish_even_sampled(engine):
    jobs = {
        f"p{i}": Request(
            prompt=f"Person number {i}:",
            max_tokens=150,
            response_format=SCHEMA,
            temperature=1.0,
            top_p=0.95,
            seed=i,
        )
        for i in range(12)
    }
    done = run_jobs(engine, jobs)
    for key, request in jobs.items():
        assert done[key].finish_reason == "stop", done[key].text
        stopped_outputs_conform(request, done[key])
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', done[key].text)
        assert not re.search(r"\s", outside_strings), done[key].text  # compact JSON


def test_grammar_forbids_eos_until_complete(engine):
    prompt = "it he on as"  # greedy ends with EOS after a few tokens on the tiny model
    free = run_jobs(engine, {"free": Request(prompt=prompt, max_tokens=40)})["free"]
    assert free.finish_reason == "stop" and len(free.token_ids) < 8
    fmt = RegexFormat("[a-z]{30}")
    c = run_jobs(engine, {"c": Request(prompt=prompt, max_tokens=60, response_format=fmt)})["c"]
    assert c.finish_reason == "stop" and re.fullmatch("[a-z]{30}", c.text), c.text


def test_a_constraint_that_fails_at_the_worker_fails_its_job_alone(engine):
    bad = Request(prompt="x", response_format=RegexFormat("(unclosed"), max_tokens=8)
    jobs = {
        "ok": Request(prompt="An id:", max_tokens=40, response_format=RegexFormat(REGEX)),
        "bad": bad,
        "free": Request(prompt="Hello", max_tokens=8),
    }
    done = run_jobs(engine, jobs)
    assert done["bad"].finish_reason == "error"
    assert done["bad"].error.startswith("response_format.pattern: cannot be enforced")
    assert done["ok"].finish_reason == "stop" and re.fullmatch(REGEX, done["ok"].text)
    assert done["free"].finish_reason in ("stop", "length") and done["free"].error is None


def test_logprobs_stop_strings_and_max_tokens_still_apply(engine):
    jobs = {
        "lp": Request(prompt="An id:", response_format=RegexFormat(REGEX), logprobs=5),
        "short": Request(prompt="A person:", response_format=SCHEMA, max_tokens=3),
        "stop": Request(prompt="A person:", response_format=SCHEMA, stop=[","]),
    }
    done = run_jobs(engine, jobs)
    lp = done["lp"]
    assert lp.finish_reason == "stop" and len(lp.logprobs) == len(lp.token_ids)
    assert len(lp.logprobs[0].top) == 5
    for tok, entry in zip(lp.token_ids, lp.logprobs, strict=True):
        assert entry.token_id == tok and np.isfinite(entry.logprob)
        assert all(np.isfinite(t.logprob) for t in entry.top)
    # The first character must be an upper-case letter: no alternative may break the regex.
    assert all(
        re.fullmatch("[A-Z][a-z]*", engine.tokenizer.decode([t.token_id]))
        for t in lp.logprobs[0].top
    )
    assert done["short"].finish_reason == "length" and len(done["short"].token_ids) == 3
    assert done["stop"].finish_reason == "stop" and done["stop"].text.startswith('{"name":"')
    assert "," not in done["stop"].text


def test_batch_hook_masks_only_its_rows_and_follows_their_tokens(tiny):
    """The engine-agnostic hook: ``process`` masks the tracked rows, ``accept`` steps them."""
    model, tokenizer = tiny
    vocab = model.args.vocab_size
    batch = ConstraintBatch(Grammars(tokenizer, vocab))
    batch.track("a", batch.grammars.job(RegexFormat("[a-z]{2}")))
    batch.track("c", batch.grammars.job(RegexFormat("[0-9]+")))
    logits = mx.array(np.random.default_rng(1).normal(size=(3, vocab)).astype(np.float32))
    out = np.array(batch.process(logits, ["a", "b", "c"]))
    assert (out[1] == np.array(logits)[1]).all()  # "b" is free: untouched
    allowed_a = [t for t in range(vocab) if not np.isneginf(out[0, t])]
    assert allowed_a and all(re.fullmatch("[a-z]{1,2}", tokenizer.decode([t])) for t in allowed_a)
    digits = [t for t in range(vocab) if not np.isneginf(out[2, t])]
    assert digits and all(tokenizer.decode([t]).isdigit() for t in digits)

    a_token = next(t for t in allowed_a if tokenizer.decode([t]) == "x")
    batch.accept(["a", "b", "c"], [a_token, 0, digits[0]])
    out = np.array(batch.process(logits[:2], ["c", "a"]))
    after_a = [tokenizer.decode([t]) for t in range(vocab) if not np.isneginf(out[1, t])]
    assert after_a and all(re.fullmatch("[a-z]", s) for s in after_a)
    assert set(tokenizer.eos_token_ids) & {t for t in range(vocab) if not np.isneginf(out[0, t])}
    assert not batch.failures
    batch.drop("a")
    assert "a" not in batch.jobs
    # a token its grammar does not allow fails that row alone
    letter = next(t for t in range(vocab) if tokenizer.decode([t]) == "x")
    batch.accept(["c", "b"], [letter, letter])
    assert list(batch.failures) == ["c"] and "the constraint failed" in batch.failures["c"]


def test_masks_prepared_for_a_step_stay_as_they_were_after_the_next_fill(tiny):
    """``prepare`` fills every step into one reused buffer: what it handed out stays."""
    model, tokenizer = tiny
    batch = ConstraintBatch(Grammars(tokenizer, model.args.vocab_size))
    batch.track("a", batch.grammars.job(RegexFormat("[0-9]x")))
    batch.track("b", batch.grammars.job(RegexFormat("[a-w]+")))
    first = batch.prepare()
    kept = first.masks.copy()
    digit = next(t for t in range(len(tokenizer)) if tokenizer.decode([t]) == "7")
    letter = next(t for t in range(len(tokenizer)) if tokenizer.decode([t]) == "q")
    batch.accept(["a", "b"], [digit, letter])
    second = batch.prepare()
    assert np.array_equal(first.masks, kept)
    assert not np.array_equal(second.masks[second.rows["a"]], first.masks[first.rows["a"]])


def test_run_writes_constrained_results(tiny_model, tmp_path):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "JSON?"}],
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    lines = [
        {"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": body},
        {
            "custom_id": "r",
            "prompt": "id:",
            "max_tokens": 40,
            "response_format": {"type": "regex", "pattern": REGEX},
        },
        {"custom_id": "f", "prompt": "free", "max_tokens": 8},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {k: v for k, v in os.environ.items() if k != "MLXQ_REDIS_URL"}
    default = json.dumps({"type": "regex", "pattern": "[0-9]{3}"})  # for lines without one
    args = ("run", str(src), "--model", tiny_model, "-o", str(out), "--response-format", default)
    run = run_mlxq(*args, env=env)
    assert run.returncode == 0, run.stderr
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert results["o"]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(results["o"]["text"]), schema)
    assert results["r"]["finish_reason"] == "stop" and re.fullmatch(REGEX, results["r"]["text"])
    assert results["f"]["finish_reason"] == "stop" and re.fullmatch(
        "[0-9]{3}", results["f"]["text"]
    )

    # A table, every row under --json-schema; a broken one is refused before anything runs.
    table, schema_file = tmp_path / "q.csv", tmp_path / "answer.json"
    table.write_text("question\nIs it?\nReally?\n")
    schema_file.write_text(json.dumps(schema))
    rows = ("run", str(table), "--template", "Q: {question}\nA:", "--model", tiny_model)
    run = run_mlxq(*rows, "--json-schema", str(schema_file), "-o", str(out), env=env)
    assert run.returncode == 0, run.stderr
    answers = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["finish_reason"] for r in answers] == ["stop", "stop"]
    for r in answers:
        jsonschema.validate(json.loads(r["text"]), schema)
    schema_file.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    run = run_mlxq(*rows, "--json-schema", str(schema_file), "-o", str(out), env=env)
    assert run.returncode != 0 and "uniqueItems" in run.stderr and "Traceback" not in run.stderr


def test_hook_protocol_for_engines_that_process_the_whole_batch(tiny):
    """``ConstraintHook`` driven as an engine drives a batch logits hook, greedy to the end."""
    model, tokenizer = tiny
    vocab = model.args.vocab_size
    hook = ConstraintHook.for_model(model, tokenizer)
    assert hook.check(Request(prompt="x", response_format=RegexFormat("(x"))) is not None
    assert hook.check(Request(prompt="x", response_format=RegexFormat(REGEX))) is None
    hook.admit("j", Request(prompt="x", response_format=RegexFormat(REGEX)))
    hook.admit("free", Request(prompt="x"))
    assert hook.active
    rng, text = np.random.default_rng(2), []
    for _ in range(40):
        logits = mx.array(rng.normal(size=(2, vocab)).astype(np.float32))
        tokens = mx.argmax(hook.process(logits, ["free", "j"]), axis=-1).tolist()
        assert tokens[0] == int(np.argmax(np.array(logits)[0]))  # the free row: untouched
        hook.accept(["free", "j"], tokens)
        if tokens[1] in tokenizer.eos_token_ids:
            break
        text.append(tokens[1])
    assert re.fullmatch(REGEX, tokenizer.decode(text)) and not hook.failures()
    hook.release("j")
    assert not hook.active
    hook.admit("unchecked", Request(prompt="x", response_format=RegexFormat("(x")))
    assert "cannot be enforced" in hook.failures()["unchecked"]
    out = np.array(hook.process(mx.zeros((1, vocab)), ["unchecked"]))[0]
    assert {t for t in range(vocab) if not np.isneginf(out[t])} == set(tokenizer.eos_token_ids)


def test_constrained_jobs_start_from_a_cached_prefix(tiny):
    """With the prefix cache, constrained greedy output is still the single-request one."""
    engine = BatchGeneratorEngine.from_loaded(
        *tiny, "tiny", max_batch=8, prefix_cache_bytes=1 << 24
    )
    shared = "You label reviews. Answer with JSON only. " * 4
    jobs = {
        f"r{i}": Request(prompt=shared + f"Review {i}:", max_tokens=120, response_format=SCHEMA)
        for i in range(4)
    }
    done = run_jobs(engine, jobs)
    done |= run_jobs(engine, {"again": jobs["r0"]})
    assert engine.stats().prefix_hits > 0
    for key, request in [*jobs.items(), ("again", jobs["r0"])]:
        assert done[key].finish_reason == "stop"
        want = constrained_reference(tiny, engine.encode(request), request)
        assert done[key].token_ids == want, key


def test_a_job_released_while_the_helper_fills_masks_is_dropped_after_it(tiny):
    """The engine finishes jobs while the helper thread still fills the next masks: the
    drop waits for the helper (a failure it records must not outlive the job), and the
    hook reads as inactive at once."""
    model, tokenizer = tiny
    vocab = model.args.vocab_size
    hook = ConstraintHook.for_model(model, tokenizer)
    hook.admit("j", Request(prompt="x", response_format=RegexFormat(REGEX)))
    logits = mx.array(np.random.default_rng(3).normal(size=(1, vocab)).astype(np.float32))
    token = mx.argmax(hook.process(logits, ["j"]), axis=-1).tolist()
    hook.accept(["j"], token)  # the helper advances the matcher and fills its next mask
    hook.release("j")
    assert not hook.active and not hook.failures()
    hook.accept([], [])  # the next step settles the helper first
    assert "j" not in hook.batch.jobs and not hook.batch.failures and not hook.active
