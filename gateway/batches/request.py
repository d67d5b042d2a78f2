"""What a client submits to POST /v1/batches, as the batch service takes it (msgspec), and how a
stored item is read back as the request of its endpoint.

Two forms: OpenAI's (`input_file_id` of an uploaded JSONL file, `endpoint`, `completion_window`),
and this gateway's inline extension (`model` and the `requests` themselves, each the body of a
/v1/completions request with a custom_id). Items are stored as their body less `model` (the
batch names it) and read back through the endpoint's own schema, so an item is exactly the
request it stands for.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar, cast

import msgspec

from gateway import client_json
from gateway.chat.request import ChatCompletionRequest
from gateway.completions.request import CompletionFields, CompletionRequest
from gateway.errors import GatewayError, invalid_request
from gateway.files.batch_input import CustomId, Endpoint

T = TypeVar("T")
COMPLETIONS: Endpoint = "/v1/completions"
CHAT: Endpoint = "/v1/chat/completions"
# A completion window is hours, as OpenAI writes it ("24h"), up to a week.
_WINDOW = re.compile(r"^([1-9][0-9]{0,2})h$")
MAX_WINDOW_H = 168


class BatchRequestItem(CompletionFields, kw_only=True, omit_defaults=True):
    """One request of an inline batch: the client's custom_id and the body fields of
    /v1/completions, less `model` (the batch names it) and streaming (results are collected,
    not streamed). Validated exactly as /v1/completions validates them."""

    custom_id: CustomId


class BatchCreateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/batches, either form. metadata follows OpenAI's rules: up to 16 pairs, keys up
    to 64 characters, values up to 512. Inline requests stay raw JSON until each is checked
    against the item size limit and decoded on its own, naming it when it is malformed."""

    input_file_id: str | None = None
    endpoint: str | None = None
    completion_window: str | None = None
    model: str | None = None
    requests: list[msgspec.Raw] | None = None
    metadata: dict[str, str] | None = None


class BatchCreateSchema(msgspec.Struct, forbid_unknown_fields=True):
    """BatchCreateRequest as the OpenAPI document describes it (inline items spelled out)."""

    input_file_id: str | None = None
    endpoint: Endpoint | None = None
    completion_window: str | None = None
    model: str | None = None
    requests: list[BatchRequestItem] | None = None
    metadata: dict[str, str] | None = None


def window_hours(window: str | None, param: str = "completion_window") -> int | None:
    """The completion window in hours ("24h" -> 24); None when not given."""
    if window is None:
        return None
    match = _WINDOW.match(window)
    if match is None or int(match.group(1)) > MAX_WINDOW_H:
        raise invalid_request(
            f"completion_window must be a number of hours up to {MAX_WINDOW_H}, like '24h' "
            f"(got '{window}')",
            param=param,
        )
    return int(match.group(1))


def decode_item(where: str, raw: msgspec.Raw, max_bytes: int) -> BatchRequestItem:
    """The inline request at `where`, or 400 naming it: over `max_bytes` (the body limit of
    /v1/completions), or not a valid item."""
    if len(raw) > max_bytes:
        raise invalid_request(
            f"{where} is {len(raw)} bytes; a request takes at most {max_bytes} bytes (the body "
            "limit of /v1/completions)",
            param=where,
            code="request_too_large",
        )
    try:
        return client_json.decode(raw, BatchRequestItem)
    except msgspec.DecodeError as exc:  # (ValidationError is one)
        raise invalid_request(f"{where}: invalid request: {exc}", param=where) from exc


def item_body(item: BatchRequestItem) -> dict[str, object]:
    """An inline item as stored: the fields that differ from their defaults, less custom_id."""
    body = cast(dict[str, object], msgspec.to_builtins(item))
    del body["custom_id"]
    return body


def completion_request(model: str, body: dict[str, Any]) -> CompletionRequest:
    """A stored item as the /v1/completions request it stands for."""
    return _convert(model, body, CompletionRequest)


def chat_request(model: str, body: dict[str, Any]) -> ChatCompletionRequest:
    """A stored item as the /v1/chat/completions request it stands for."""
    return _convert(model, body, ChatCompletionRequest)


def _convert(model: str, body: dict[str, Any], schema: type[T]) -> T:
    try:
        return client_json.convert({**body, "model": model}, schema)
    except msgspec.ValidationError as exc:
        raise invalid_request(f"invalid request: {exc}") from exc


def line_body(raw: msgspec.Raw) -> dict[str, Any]:
    """A file line's body as a JSON object (batch_input checked that it is one)."""
    try:
        body = client_json.decode_any(raw)
    except msgspec.DecodeError as exc:  # checked at upload; a file is never changed after
        raise invalid_request(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise invalid_request("body must be a JSON object")
    return body


def item_error(where: str, custom_id: str, exc: GatewayError) -> GatewayError:
    """An item's validation error, naming the item, for a batch refused whole."""
    return invalid_request(
        f"{where} (custom_id '{custom_id}'): {exc.message}; no request of the batch was accepted",
        param=f"{where}.{exc.param}" if exc.param else where,
        code=exc.code,
    )
