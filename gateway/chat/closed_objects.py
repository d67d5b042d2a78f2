"""Schemas with their objects closed: the keys a schema declares and no others. A forced tool
call's arguments are held to them, and so is a `strict` response_format schema.

JSON Schema lets an object hold keys its schema does not name unless `additionalProperties` is
false, and most tool schemas leave it unset (pydantic's, LangChain's, hand-written ones). A
constraint enforcing such a schema as given lets a small model invent key after key until
`max_tokens` cuts the call (issue 49: SmolLM2 did in 4 of 12 forced calls). So when a call is
forced (`tool_choice` required or named), the arguments are held to the closed schema: every
answer it allows is one the client's schema allows, without the keys nobody asked for. A
`strict: true` json_schema response_format is closed alike (closed_schema): OpenAI treats a
strict schema's objects as closed, and clients send strict schemas that do not say so (a
pydantic model's schema with `strict: true` beside it), with which a small model invented keys
until `max_tokens`. A schema sent without `strict` (instructor 1.17.0's JSON_SCHEMA mode sends
none) is not closed.

What is closed, where the schema leaves `additionalProperties` (and `unevaluatedProperties`)
unset:
- the arguments object itself, properties declared or not: a function's parameters are the keys
  it declares (OpenAI: omitted parameters mean an empty parameter list);
- every nested object that declares `properties`: in properties, items, `anyOf`/`oneOf`
  alternatives, `$defs`/`definitions`.

The arguments are an object, always: a schema that leaves the root's `type` unset (`{}`, a bare
`properties`, an `anyOf` of shapes) lets the grammar write any JSON value there, and a small
model wrote a list (issue 58: 3 of 6 forced calls with `parameters: {}` came back as no call at
all, finish_reason "stop"). JSON Schema ANDs the keywords of one object, so `"type": "object"`
beside the client's keywords admits exactly the objects its schema admits; a `type` list is
narrowed to its "object". A `type` without "object" is refused earlier (tools.py).

Left as given: nested objects declaring no properties (free-form maps), objects whose
`required` names keys they do not declare, objects combined with sibling `allOf`/`anyOf`/
`oneOf`/`$ref` (the other schemas may declare keys of the same object) and those other schemas
themselves (each declares part of one object), and anything under `not`, `if`, `then`, `else`
(closing inside a negation would widen it).
"""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems")
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref")


def closed_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (a function's parameters) held to an object, with its objects closed; the input
    is not changed."""
    return _closed_object({**schema, "type": "object"}, close=True, root=True)


def closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A strict response_format's `schema` with its objects closed (by the rules above, the root
    as any nested object: closed when it declares its properties); the input is not changed."""
    return _closed_object(schema, close=True)


def admits_objects(schema: dict[str, Any]) -> bool:
    """Whether a function's parameters may describe an object at all (its `type`, if given,
    is or lists "object")."""
    kind = schema.get("type", "object")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _closed(schema: Any, *, close: bool) -> Any:
    if not isinstance(schema, dict):
        return schema  # a boolean schema, or a malformed one llguidance will refuse
    return _closed_object(schema, close=close)


def _closed_object(schema: dict[str, Any], *, close: bool, root: bool = False) -> dict[str, Any]:
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub, close=True) for name, sub in out[key].items()}
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [_closed(sub, close=True) for sub in out["prefixItems"]]
    for key in _SCHEMA_VALUES:
        value = out.get(key)
        if isinstance(value, list):  # draft 4's tuple `items`
            out[key] = [_closed(sub, close=True) for sub in value]
        elif isinstance(value, dict):
            out[key] = _closed(value, close=True)
    # Alternatives beside an object's own keywords describe parts of that same object, as
    # allOf's members always do: those are not closed themselves.
    alternatives = not _declares_object(out)
    for key, whole in (("anyOf", alternatives), ("oneOf", alternatives), ("allOf", False)):
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub, close=whole) for sub in out[key]]
    if close and _open_object(out, root):
        out["additionalProperties"] = False
    return out


def _open_object(schema: dict[str, Any], root: bool) -> bool:
    """Whether `schema` is an object schema that may be closed without refusing anything it
    declares."""
    if "additionalProperties" in schema or "unevaluatedProperties" in schema:
        return False
    if any(key in schema for key in _COMBINED):
        return False
    if not _declares_object(schema):
        return False
    properties = schema.get("properties")
    if properties is None:
        return root and "patternProperties" not in schema
    if not isinstance(properties, dict):
        return False
    required = schema.get("required", [])
    return isinstance(required, list) and all(name in properties for name in required)


def _declares_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind is None:
        return isinstance(schema.get("properties"), dict)
    return kind == "object" or (isinstance(kind, list) and "object" in kind)
