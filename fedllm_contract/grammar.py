"""Decoding constraints as grammars of llguidance, the grammar engine the sites enforce them
with (bench/results/structured_output/grammar_engines.md says why that one).

The gateway and the sites build a constraint's grammar with the same function, so the gateway
can refuse a schema the sites could not enforce (an invalid schema, a feature llguidance has
not implemented, named in its own words, or one past the bounds below) before anything is
dispatched, and the site checks it again before it compiles it for its tokenizer.

The bounds (docs/security.md, "Structured outputs"): a schema of at most MAX_SCHEMA_BYTES, whose
grammar llguidance can follow token by token. llguidance's parser gives up on an answer, midway,
once one row of its Earley chart holds more than its `max_items_in_row` (2000) items; a
schema's `anyOf` puts about one item per branch there and an object about four per optional
property (measured with SmolLM2's tokenizer: 2001 branches or 500 optional properties were the
first to fail), so wider ones are refused here, by where they are, before any token is spent.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # a TypedDict of the stubs only
    from llguidance import LLParserLimits
    from llguidance._lib import JsonCompileOptions

ConstraintKind = Literal["json_schema", "json_object", "tagged_json"]
# JSON as json.dumps writes it by default: ", " between items, ": " after keys, no other
# whitespace. A small model given free whitespace spends its tokens on newlines and indentation
# (issue 49: a newline between almost every token); this form is what chat templates render
# earlier tool calls in (`tojson`) and what the gateway writes them as, so the model continues
# the form its prompt shows, and it leaves nothing to loop on.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# The UTF-8 bytes of a constraint's schema text (for tagged_json, its one item schema, which
# holds every tool of a request). Compile time grows with size, about 3-8 ms per KiB on the
# site's CPU and half that for the gateway's check (an ad hoc measurement on the 2-core dev
# machine, issue 48; the stall it causes is bench.structured.grammar_stall's): this
# bounds a request's compile to about a second; the largest schemas clients send in practice
# (every tool of an agent framework) are tens of KiB.
MAX_SCHEMA_BYTES = 256 * 1024
# llguidance's max_items_in_row is 2000; half of it leaves room for what nests around them.
MAX_ANY_OF_BRANCHES = 1000
MAX_OPTIONAL_PROPERTIES = 400
# Keywords whose values are data, not schemas: their contents are not walked.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "description", "title"})


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


def parser_limits() -> LLParserLimits:
    """The limits every matcher of a constraint runs under, at the gateway and the sites alike:
    llguidance's defaults, with short errors (the long form carries the parser's state)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def _walk(schema: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """Every schema object in `schema` with its JSON pointer, data keywords' values left out.
    A loop, not recursion: a schema may nest deeper than Python's stack."""
    stack: list[tuple[object, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            yield node, where or "/"
            for key, value in node.items():
                if key not in _DATA_KEYWORDS:
                    escaped = str(key).replace("~", "~0").replace("/", "~1")
                    stack.append((value, f"{where}/{escaped}"))
        elif isinstance(node, list):
            stack.extend((value, f"{where}/{index}") for index, value in enumerate(node))


def _check_breadth(schema: dict[str, Any]) -> None:
    for node, where in _walk(schema):
        for keyword in ("anyOf", "oneOf"):
            branches = node.get(keyword)
            if isinstance(branches, list) and len(branches) > MAX_ANY_OF_BRANCHES:
                raise UnenforceableConstraint(
                    f"the {keyword} at {where} has {len(branches)} branches, more than the "
                    f"{MAX_ANY_OF_BRANCHES} the grammar engine can follow"
                )
        properties = node.get("properties")
        if isinstance(properties, dict):
            required = node.get("required")
            named = set(required) if isinstance(required, list) else set()
            optional = sum(1 for name in properties if name not in named)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise UnenforceableConstraint(
                    f"the object at {where} has {optional} optional properties, more than the "
                    f"{MAX_OPTIONAL_PROPERTIES} the grammar engine can follow (list them in "
                    "`required`, as strict schemas do)"
                )


def _schema(text: str) -> dict[str, Any]:
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise UnenforceableConstraint(
            f"the JSON schema is {size:,} bytes; at most {MAX_SCHEMA_BYTES:,} are compiled"
        )
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UnenforceableConstraint(f"the JSON schema is not JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise UnenforceableConstraint("a JSON schema is an object")
    _check_breadth(schema)
    return schema


def _tagged_lark(spec: ConstraintSpec, schema: dict[str, Any]) -> str:
    low, high = spec.min_items, spec.max_items or None
    if low < 0 or (high is not None and high < max(low, 1)):
        raise UnenforceableConstraint("tagged JSON needs 0 <= min_items <= max_items")
    # A schema's own "x-guidance" options come after these (llguidance's order), as with
    # json_schema's defaults.
    item_schema = {"x-guidance": JSON_OPTIONS, **schema}
    item = " ".join(
        (json.dumps(spec.begin), "%json", json.dumps(item_schema), json.dumps(spec.end))
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

    from_schema = llguidance.LLMatcher.grammar_from_json_schema
    if spec.kind == "json_object":
        text = from_schema(json.dumps(ANY_OBJECT), JSON_OPTIONS)
    elif spec.kind == "json_schema":
        _schema(spec.schema)
        # The text, not the parsed dict: llguidance converts a dict holding the GIL (~0.3 s
        # for a 500 KiB schema), and parses text without it.
        text = from_schema(spec.schema, JSON_OPTIONS)
    elif spec.kind == "tagged_json":
        text = llguidance.LLMatcher.grammar_from_lark(_tagged_lark(spec, _schema(spec.schema)))
    else:
        raise UnenforceableConstraint(f"unknown constraint kind {spec.kind!r}")
    error = llguidance.LLMatcher.validate_grammar(text, limits=parser_limits())
    if error:
        raise UnenforceableConstraint(error)
    return text


@functools.lru_cache(maxsize=128)
def refusal(spec: ConstraintSpec) -> str:
    """Why the grammar engine cannot enforce `spec` ('' if it can): grammar()'s verdict,
    remembered for the last 128 constraints (clients send the same schema again and again;
    at most MAX_SCHEMA_BYTES each)."""
    try:
        grammar(spec)
    except UnenforceableConstraint as exc:
        return str(exc)
    return ""
