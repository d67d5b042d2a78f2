"""response_format as a decoding constraint: `json_object` (any JSON object) or `json_schema`
(the answer validates against the schema), enforced token by token at the site.

A schema the grammar engine cannot enforce (invalid, or using a feature it has not implemented)
is a 400 naming the parameter and, in the engine's words, what it cannot do: never an answer
that was not held to it. Every schema is enforced whole; a `strict` one with its objects closed
(gateway/chat/closed_objects.py), as OpenAI reads a strict schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fedllm_contract.grammar import ConstraintSpec, refusal
from gateway.chat.closed_objects import closed_schema
from gateway.errors import invalid_request

# OpenAI's rule for a schema's (and a function's) name.
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
PARAM = "response_format"


def checked(spec: ConstraintSpec, param: str, what: str) -> ConstraintSpec:
    """`spec`, or a 400 at `param` when the grammar engine cannot enforce it."""
    why = refusal(spec)
    if why:
        raise invalid_request(f"{param}: {what} cannot be enforced: {why}", param=param)
    return spec


def schema_text(schema: object, param: str) -> str:
    """The schema as JSON text, its keys in the client's order: the grammar writes an object's
    properties in the order its schema lists them (as OpenAI does; sorted, a schema's
    `reasoning` would come after its `answer`)."""
    if not isinstance(schema, dict):
        raise invalid_request(f"{param}: a JSON schema is a JSON object", param=param)
    return json.dumps(schema)


def response_constraint(value: dict[str, Any] | None) -> ConstraintSpec | None:
    """The constraint a response_format asks for (None: free text)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind != "json_schema":
        raise invalid_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema' (got {kind!r})",
            param=f"{PARAM}.type",
        )
    spec = value.get("json_schema")
    where = f"{PARAM}.json_schema"
    if not isinstance(spec, dict):
        raise invalid_request("json_schema must be an object with a name and a schema", where)
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid_request(
            "json_schema.name must be 1-64 letters, digits, '_' or '-'", param=f"{where}.name"
        )
    schema = spec.get("schema", {"type": "object"})
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_request("json_schema.strict must be a boolean", param=f"{where}.strict")
    if strict and isinstance(schema, dict):
        schema = closed_schema(schema)
    text = schema_text(schema, f"{where}.schema")
    return checked(ConstraintSpec("json_schema", schema=text), f"{where}.schema", "this schema")
