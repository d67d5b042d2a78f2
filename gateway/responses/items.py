"""The items of a conversation in the Responses API: messages, function calls and their outputs.

A client's `input` items come in many spellings (a bare string, `{"role", "content"}` without a
type, content as a string or as parts, items copied back from an earlier response's `output`);
`input_items` turns them into one canonical form, the shapes the API answers with, which is also
what a stored response keeps and what GET .../input_items lists. What this gateway cannot feed
a text model (images, files, audio, built-in tool calls, reasoning items, item references) is
refused with the item's path.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import msgspec

from gateway.errors import invalid_request

ItemStatus = Literal["in_progress", "completed", "incomplete"]
Role = Literal["user", "system", "developer", "assistant"]
ROLES: tuple[Role, ...] = ("user", "system", "developer", "assistant")
# Part types whose text a model reads; `refusal` is an assistant's earlier refusal, read as text.
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
# Keys an item may carry beyond its own: an earlier output's bookkeeping, which changes nothing.
_PASSIVE_KEYS = frozenset({"id", "status", "type"})
_MESSAGE_KEYS = _PASSIVE_KEYS | {"role", "content", "phase"}
_CALL_KEYS = _PASSIVE_KEYS | {"call_id", "name", "arguments"}
_OUTPUT_KEYS = _PASSIVE_KEYS | {"call_id", "output"}
_PART_EXTRA_KEYS = frozenset({"annotations", "logprobs", "prompt_cache_breakpoint"})


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class InputText(msgspec.Struct, tag="input_text", tag_field="type"):
    text: str


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class MessageItem(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    role: Role
    content: list[InputText | OutputText]
    status: ItemStatus = "completed"

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content)


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text, as the API sends it
    status: ItemStatus = "completed"


class FunctionCallOutputItem(msgspec.Struct, tag="function_call_output", tag_field="type"):
    id: str
    call_id: str
    output: str
    status: ItemStatus = "completed"


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
OutputItem = MessageItem | FunctionCallItem


def _refuse_unknown(entry: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    extra = sorted(set(entry) - allowed)
    if extra:
        raise invalid_request(
            f"'{extra[0]}' is not supported on this item by this gateway", f"{where}.{extra[0]}"
        )


def _string(entry: dict[str, Any], key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str):
        raise invalid_request(f"{key} must be a string", param=f"{where}.{key}")
    return value


def _part_text(part: object, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(part, dict) or kind not in _TEXT_PARTS:
        raise invalid_request(
            f"content parts of type {kind!r} are not supported: only text "
            "('input_text', 'output_text')",
            param=f"{where}.type",
        )
    key = _TEXT_PARTS[kind]
    _refuse_unknown(part, frozenset({"type", key}) | _PART_EXTRA_KEYS, where)
    return _string(part, key, where)


def _texts(content: object, where: str) -> list[str]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid_request("content is a string or a list of parts", f"{where}.content")
    return [_part_text(part, f"{where}.content[{i}]") for i, part in enumerate(content)]


def _message(entry: dict[str, Any], where: str) -> MessageItem:
    _refuse_unknown(entry, _MESSAGE_KEYS, where)
    role = entry.get("role")
    if role not in ROLES:
        raise invalid_request(
            f"role {role!r} is not supported: use one of {', '.join(ROLES)}", f"{where}.role"
        )
    texts = _texts(entry.get("content"), where)
    parts: list[InputText | OutputText] = (
        [OutputText(text) for text in texts] if role == "assistant" else
        [InputText(text) for text in texts]
    )  # fmt: skip
    return MessageItem(_given_id(entry, "msg"), role, parts)


def _given_id(entry: dict[str, Any], prefix: str) -> str:
    given = entry.get("id")
    return given if isinstance(given, str) and given else new_id(prefix)


def _function_call(entry: dict[str, Any], where: str) -> FunctionCallItem:
    _refuse_unknown(entry, _CALL_KEYS, where)
    arguments = _string(entry, "arguments", where)
    try:
        json.loads(arguments)
    except ValueError as exc:
        raise invalid_request("arguments are JSON text", param=f"{where}.arguments") from exc
    return FunctionCallItem(
        _given_id(entry, "fc"), _string(entry, "call_id", where), _string(entry, "name", where),
        arguments,
    )  # fmt: skip


def _function_call_output(entry: dict[str, Any], where: str) -> FunctionCallOutputItem:
    _refuse_unknown(entry, _OUTPUT_KEYS, where)
    output = entry.get("output")
    if not isinstance(output, str | list):
        raise invalid_request("output is a string or a list of parts", param=f"{where}.output")
    text = output if isinstance(output, str) else "\n".join(_texts(output, where))
    return FunctionCallOutputItem(_given_id(entry, "fco"), _string(entry, "call_id", where), text)


_REFUSED_KINDS = {
    "item_reference": "item references are not supported: send the item itself, or "
    "previous_response_id",
    "reasoning": "reasoning items are not supported: this gateway's models do not reason "
    "separately",
}


def input_item(entry: object, where: str) -> Item:
    """One `input` item in canonical form, or a 400 at `where`."""
    if not isinstance(entry, dict):
        raise invalid_request("an input item is a JSON object", param=where)
    kind = entry.get("type", "message" if "role" in entry else None)
    if kind == "message":
        return _message(entry, where)
    if kind == "function_call":
        return _function_call(entry, where)
    if kind == "function_call_output":
        return _function_call_output(entry, where)
    reason = _REFUSED_KINDS.get(
        str(kind),
        f"input items of type {kind!r} are not supported: messages, function_call and "
        "function_call_output",
    )
    raise invalid_request(reason, param=f"{where}.type")


def input_items(value: str | list[dict[str, Any]] | None) -> list[Item]:
    """The request's `input` as canonical items (a string is one user message)."""
    if value is None:
        raise invalid_request("input is required: a string or a list of items", param="input")
    if isinstance(value, str):
        return [MessageItem(new_id("msg"), "user", [InputText(value)])]
    if not value:
        raise invalid_request("input must hold at least one item", param="input")
    return [input_item(entry, f"input[{i}]") for i, entry in enumerate(value)]


def items_from_json(value: object) -> list[Item]:
    """Items as stored (msgspec's builtins of `Item`s)."""
    return msgspec.convert(value, list[Item])
