"""Decoding constraints as grammars of llguidance, the grammar engine the sites enforce them
with (bench/results/structured_output/grammar_engines.md says why that one).

The gateway and the sites build a constraint's grammar with the same function, so the gateway
can refuse a schema the sites could not enforce (an invalid schema, or a feature llguidance has
not implemented, named in its own words) before anything is dispatched, and the site checks it
again before it compiles it for its tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # a TypedDict of the stubs only
    from llguidance._lib import JsonCompileOptions

ConstraintKind = Literal["json_schema", "json_object", "tagged_json"]
# Whitespace between JSON tokens: what models write (spaces, newlines, indentation), bounded so
# that a small model cannot loop on whitespace until its context is full.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class UnenforceableConstraint(ValueError):
    """The grammar engine cannot enforce this constraint; the message says why."""


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """A constraint as the contract carries it (site.proto's Constraint)."""

    kind: ConstraintKind
    schema: str = ""  # JSON text: json_schema, and each item of tagged_json
    begin: str = ""
    end: str = ""
    separator: str = ""
    min_items: int = 1
    max_items: int = 0  # 0: no upper bound


def _schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise UnenforceableConstraint(f"the JSON schema is not JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise UnenforceableConstraint("a JSON schema is an object")
    return schema


def _tagged_lark(spec: ConstraintSpec) -> str:
    low, high = spec.min_items, spec.max_items or None
    if low < 0 or (high is not None and high < max(low, 1)):
        raise UnenforceableConstraint("tagged JSON needs 0 <= min_items <= max_items")
    item = " ".join(
        (json.dumps(spec.begin), "%json", json.dumps(_schema(spec.schema)), json.dumps(spec.end))
    )
    more = f"({json.dumps(spec.separator) if spec.separator else ''} item)"
    if high == 1:
        body = "item"
    elif high is None:
        body = f"item {more}*" if low <= 1 else f"item {more}{{{low - 1},}}"
    else:
        body = f"item {more}{{{max(low - 1, 0)},{high - 1}}}"
    if low == 0:
        body = f"({body})?"
    return f"%llguidance {{}}\nstart: {body}\nitem: {item}\n"


def grammar(spec: ConstraintSpec) -> str:
    """The llguidance grammar of a constraint; UnenforceableConstraint if it is not one the
    engine can enforce (checked without a tokenizer: the same verdict at the gateway)."""
    # Imported here: the engine's modules import this one, and a machine that never serves a
    # constrained request (a GPU benchmark of plain decoding) need not have llguidance.
    import llguidance

    if spec.kind == "json_object":
        text = llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, JSON_OPTIONS)
    elif spec.kind == "json_schema":
        text = llguidance.LLMatcher.grammar_from_json_schema(_schema(spec.schema), JSON_OPTIONS)
    elif spec.kind == "tagged_json":
        text = llguidance.LLMatcher.grammar_from_lark(_tagged_lark(spec))
    else:
        raise UnenforceableConstraint(f"unknown constraint kind {spec.kind!r}")
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise UnenforceableConstraint(error)
    return text
