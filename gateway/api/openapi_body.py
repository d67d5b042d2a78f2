"""OpenAPI request bodies for handlers that decode their raw body themselves.

The JSON APIs read `request.body()` and decode it with msgspec (gateway/api/body.py), so that a
bad body gets an OpenAI-shaped error rather than litestar's. Litestar then sees no `data`
parameter and leaves the operation without a requestBody, which leaves clients (and the schema
fuzzer, tests/e2e/test_schema_fuzz.py) nothing to go on. `json_body(T)` is an `operation_class`
for the route decorator that describes the body as msgspec's JSON schema of T, definitions
inlined (no shared components needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import msgspec
from litestar.openapi.spec import OpenAPIMediaType, Operation, RequestBody, Schema

_DEFS_PREFIX = "#/$defs/"


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_DEFS_PREFIX):
            name = ref[len(_DEFS_PREFIX) :]
            if name in seen:  # a recursive type: stop at any JSON value
                return {}
            return _inline(defs[name], defs, (*seen, name))
        return {key: _inline(value, defs, seen) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline(value, defs, seen) for value in node]
    return node


def json_schema(body_type: type[Any]) -> dict[str, Any]:
    """msgspec's JSON schema of body_type with every $defs reference inlined."""
    schema: dict[str, Any] = msgspec.json.schema(body_type)
    defs = schema.pop("$defs", {})
    inlined: dict[str, Any] = _inline(schema, defs)
    return inlined


def json_body(body_type: type[Any]) -> type[Operation]:
    """An Operation class whose requestBody is a required JSON document of body_type."""
    schema = json_schema(body_type)

    @dataclass
    class JsonBodyOperation(Operation):
        def __post_init__(self) -> None:
            # litestar copies plain dicts into the document as they are (BaseSchemaObject).
            media = OpenAPIMediaType(schema=cast(Schema, schema))
            self.request_body = RequestBody(content={"application/json": media}, required=True)

    return JsonBodyOperation


def multipart_body(schema: dict[str, Any]) -> type[Operation]:
    """An Operation class whose requestBody is a required multipart/form-data form of
    `schema` (a JSON schema object; a file field is `{"type": "string", "format": "binary"}`)."""

    @dataclass
    class MultipartBodyOperation(Operation):
        def __post_init__(self) -> None:
            media = OpenAPIMediaType(schema=cast(Schema, schema))
            self.request_body = RequestBody(content={"multipart/form-data": media}, required=True)

    return MultipartBodyOperation
