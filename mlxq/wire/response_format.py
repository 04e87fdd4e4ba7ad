"""``response_format``: the shape a job's output must take (OpenAI's, plus regex and Lark).

OpenAI's ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` and
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``, and mlxq's
``{"type": "regex", "pattern": "..."}`` and ``{"type": "grammar", "lark": "..."}``. These
types check the shape only; :mod:`mlxq.engine.constraints.grammar` compiles the content.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

_Text = Annotated[str, Meta(min_length=1)]


class JsonSchemaSpec(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """OpenAI's ``json_schema`` object. The schema is always enforced, strict or not."""

    schema: dict[str, Any]
    name: Annotated[str, Meta(min_length=1, max_length=64)] = "response"
    strict: bool | None = None
    description: str | None = None


class TextFormat(Struct, forbid_unknown_fields=True, tag_field="type", tag="text"):
    """Free text: no constraint (OpenAI's default)."""


class JsonObjectFormat(Struct, forbid_unknown_fields=True, tag_field="type", tag="json_object"):
    """Any JSON object."""


class JsonSchemaFormat(Struct, forbid_unknown_fields=True, tag_field="type", tag="json_schema"):
    """JSON that validates against ``json_schema.schema``."""

    json_schema: JsonSchemaSpec


class RegexFormat(Struct, forbid_unknown_fields=True, tag_field="type", tag="regex"):
    """Text that matches ``pattern`` in full (Rust ``regex`` syntax, no look-around)."""

    pattern: _Text


class GrammarFormat(Struct, forbid_unknown_fields=True, tag_field="type", tag="grammar"):
    """Text that parses under the Lark grammar ``lark`` (its ``start`` rule)."""

    lark: _Text


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat
