"""Decoding request bodies into wire schemas with OpenAI-shaped errors."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from gateway import client_json
from gateway.api.openai_errors import OpenAIError, invalid_request

T = TypeVar("T")
# The field at fault: msgspec names it "at `$.field...`", or "at `key` in `$.field`" for a
# mapping's key (metadata's).
_PARAM_PATH = re.compile(r"`\$\.([A-Za-z_]+)")
_MISSING_FIELD = re.compile(r"missing required field `([A-Za-z_]+)`")


def decode_body(body: bytes, schema: type[T]) -> T:
    if not body:
        raise invalid_request("the request body is empty; send a JSON object")
    try:
        return client_json.decode(body, schema)
    except UnicodeDecodeError as exc:
        raise invalid_request("the request body is not valid UTF-8") from exc
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = _PARAM_PATH.search(message) or _MISSING_FIELD.search(message)
        raise invalid_request(
            f"invalid request: {message}", param=param.group(1) if param else None
        ) from exc
    except msgspec.DecodeError as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from exc


_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`(?: - at `\$\.?([^`]*)`)?")


def decode_naming_unknown(body: bytes, schema: type[T]) -> T:
    """decode_body, with an unknown field refused by its path (`store`, `reasoning.foo`) as a
    parameter this gateway does not support."""
    try:
        return decode_body(body, schema)
    except OpenAIError as exc:
        match = _UNKNOWN_FIELD.search(exc.body.message)
        if match is None:
            raise
        field, where = match.groups()
        param = f"{where}.{field}" if where else field
        raise invalid_request(
            f"'{param}' is not supported by this gateway (unknown or unsupported parameter)",
            param=param,
        ) from exc
