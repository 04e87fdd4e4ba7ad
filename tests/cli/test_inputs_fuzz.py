"""Fuzzing mlxq.formats.inputs: whatever a line holds, ``parse_line`` returns a Request
(one that can go to Redis) or raises InvalidLine naming the line; ``parse_lines`` never
raises; valid requests round-trip. ``MLXQ_FUZZ_EXAMPLES`` sets the examples per test."""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxq.formats.inputs import InvalidLine, parse_line, parse_lines
from mlxq.formats.openai_input import _BODY_FIELDS
from mlxq.wire import Request, json_encoder

_KEYS = [*Request.__struct_fields__, "custom_id", "method", "url", "body", "model", "x"]
# The body keys the parser knows, and some it does not.
_BODY_KEYS = sorted(
    {key for keys in _BODY_FIELDS.values() for key in keys} | {"echo", "best_of", "tools"}
)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["POST", "GET", "/v1/chat/completions", "/v1/completions", "user", "text"])
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from([*_KEYS, *_BODY_KEYS, "role", "content", "type"]), inner, max_size=5
        )
    ),
    max_leaves=12,
)
_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "other", None, 3, [], {}])},
    optional={"text": _json, "image_url": _json},
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "", 3]),
        "content": _json | st.lists(_part | _json, max_size=3),
    },
    optional={"name": _json, "type": _json},
)
_openai_lines = st.fixed_dictionaries(
    {
        "custom_id": st.one_of(st.text(max_size=4), st.integers(), st.none()),
        "method": st.sampled_from(["POST", "GET", None]),
        "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/x", None]),
        "body": st.dictionaries(
            st.sampled_from(_BODY_KEYS), _json | st.lists(_message, max_size=3), max_size=6
        )
        | _json,
    }
)
_mlxq_lines = st.dictionaries(
    st.sampled_from(_KEYS), _json | st.lists(_message, max_size=3), max_size=6
)


def _check_parse(raw: bytes | str) -> None:
    try:
        r = parse_line(raw, 5)
    except InvalidLine as e:
        assert e.line == 5
        assert isinstance(e.message, str) and e.message
        assert "\n" not in e.message
        return
    assert isinstance(r, Request)
    assert r.custom_id
    json_encoder.encode(r)  # it can go to Redis


# MLXQ_FUZZ_EXAMPLES=20000 fuzzes harder; no example database, so no .hypothesis/ folder.
_EXAMPLES = int(os.environ.get("MLXQ_FUZZ_EXAMPLES", "300"))
_fuzz = settings(
    max_examples=_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@_fuzz
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(raw):
    _check_parse(raw)


@_fuzz
@given(st.text(max_size=100))
def test_fuzz_random_text(raw):
    _check_parse(raw)


@_fuzz
@given(_json | _mlxq_lines | _openai_lines)
def test_fuzz_json_objects(obj):
    _check_parse(json.dumps(obj))


@_fuzz
@given(_mlxq_lines | _openai_lines, st.integers(0, 10_000))
def test_fuzz_mutated_json(obj, seed):
    raw = bytearray(json.dumps(obj).encode())
    if raw:
        raw[seed % len(raw)] = seed % 256
    _check_parse(bytes(raw))


@settings(_fuzz, max_examples=max(1, _EXAMPLES // 3))
@given(st.lists(st.binary(max_size=40) | _mlxq_lines.map(json.dumps).map(str.encode), max_size=8))
def test_fuzz_parse_lines_never_raises(lines):
    parsed = parse_lines(lines)
    assert len(parsed.requests) == len(parsed.lines)
    assert parsed.lines == sorted(parsed.lines)
    ids = [r.custom_id for r in parsed.requests]
    assert len(ids) == len(set(ids))
    assert not {e.line for e in parsed.errors} & set(parsed.lines)


_requests = st.builds(
    Request,
    prompt=st.one_of(
        st.text(min_size=1, max_size=10), st.lists(st.integers(0, 2**20), min_size=1, max_size=5)
    ),
    max_tokens=st.integers(1, 1_000_000),
    temperature=st.floats(0, 10),
    top_p=st.floats(0, 1),
    top_k=st.integers(0, 100),
    seed=st.none() | st.integers(0, 2**32 - 1),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=2),
    logprobs=st.none() | st.integers(0, 20),
    custom_id=st.text(min_size=1, max_size=12),
)


@_fuzz
@given(_requests)
def test_fuzz_valid_requests_round_trip(req):
    assert parse_line(json_encoder.encode(req), 1) == req
