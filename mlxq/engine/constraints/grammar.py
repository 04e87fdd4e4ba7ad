"""Constraints of ``response_format``, compiled to llguidance grammars (pure Python, no MLX).

:func:`grammar_of` turns a request's ``response_format`` into the grammar the engine
enforces; :func:`constraint_problem` says why one cannot be enforced (a schema that does
not compile, a JSON-Schema keyword llguidance does not implement, a bad regex or Lark
grammar), so ``mlxq submit`` and ``mlxq api`` refuse its line before anything is enqueued.
Both are cached by content: a file of many lines usually repeats one schema.

JSON is generated compactly (no whitespace between tokens, ``,`` and ``:`` separators):
with flexible whitespace a model could emit spaces forever, and a bounded schema would no
longer be sure to end.
"""

from __future__ import annotations

import functools
from typing import Any

import llguidance
import msgspec

from mlxq.wire import (
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    RegexFormat,
    ResponseFormat,
)

__all__ = ["ConstraintError", "constraint_key", "constraint_problem", "grammar_of"]

_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_CACHE_SIZE = 256


class ConstraintError(ValueError):
    """A ``response_format`` that cannot be enforced; the message says why."""


def constraint_key(fmt: ResponseFormat | None) -> tuple[str, str] | None:
    """``(kind, content)`` identifying a constraint by what it says; None for free text."""
    if isinstance(fmt, JsonSchemaFormat):
        # Not sorted: the order of properties is the order they are generated in.
        return "json_schema", msgspec.json.encode(fmt.json_schema.schema).decode()
    if isinstance(fmt, JsonObjectFormat):
        return "json_schema", '{"type":"object"}'
    if isinstance(fmt, RegexFormat):
        return "regex", fmt.pattern
    if isinstance(fmt, GrammarFormat):
        return "lark", fmt.lark
    return None  # TextFormat or None


def grammar_of(fmt: ResponseFormat | None) -> str | None:
    """The llguidance grammar of ``fmt`` (None for free text); raises :class:`ConstraintError`."""
    key = constraint_key(fmt)
    if key is None:
        return None
    grammar, problem = _compiled(*key)
    if problem is not None:
        raise ConstraintError(problem)
    return grammar


def constraint_problem(fmt: ResponseFormat | None) -> str | None:
    """Why ``fmt`` cannot be enforced, as ``response_format...: reason; fix``, or None."""
    key = constraint_key(fmt)
    return None if key is None else _compiled(*key)[1]


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compiled(kind: str, content: str) -> tuple[str, str | None]:
    """The grammar and, if it cannot be enforced, why (cached, errors included)."""
    grammar = _grammar(kind, content)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        return grammar, _message(kind, " ".join(" ".join(messages).split()))
    return grammar, None


def _grammar(kind: str, content: str) -> str:
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(content)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(content)
    schema: Any = msgspec.json.decode(content)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_COMPACT_JSON)  # type: ignore[arg-type]


_WHERE = {
    "json_schema": (
        "response_format.json_schema.schema",
        "fix the schema (docs/formats.md lists the JSON-Schema keywords that are not supported)",
    ),
    "regex": ("response_format.pattern", "fix the regex (Rust regex syntax, no look-around)"),
    "lark": ("response_format.lark", "fix the grammar (Lark syntax with a `start` rule)"),
}


def _message(kind: str, reason: str) -> str:
    where, fix = _WHERE[kind]
    if len(reason) > 300:
        reason = reason[:297] + "..."
    return f"{where}: cannot be enforced: {reason}; {fix}"
