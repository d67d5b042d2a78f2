"""A Responses request as the chat request it amounts to: the one boundary where the Responses
API's spellings become chat's (gateway/chat/), so that templates, tools, structured outputs,
sampling checks and the whole request path are chat's own.

- `instructions` -> a system message first; earlier items (previous_response_id) then `input`:
  messages as messages, function calls as an assistant turn's `tool_calls` (calls that follow
  one another, or an assistant message, join one turn), their outputs as `tool` messages.
- Flat function tools `{type, name, parameters}` -> `{type, function: {...}}`; tool_choice
  `{type: function, name}` -> `{type: function, function: {name}}`; `text.format` ->
  `response_format`; `max_output_tokens` -> `max_completion_tokens`.

Chat's 400s name chat's parameters; `ParamMap.renamed` turns them back into the caller's
(`messages[3]` -> `input[1]`, `response_format.json_schema.schema` -> `text.format.schema`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, cast

from gateway.chat.request import ChatCompletionRequest, ChatMessage, ServiceTier
from gateway.errors import GatewayError, invalid_request
from gateway.responses.items import FunctionCallItem, FunctionCallOutputItem, Item, MessageItem
from gateway.responses.request import ResponseCreateRequest

_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
_TEXT_KEYS = frozenset({"format", "verbosity"})
_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\](?:\.tool_calls\[(\d+)\])?")
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function")
# Chat's parameter -> the Responses API's (longest first: the first prefix that matches wins).
_RENAMED = (
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)
PREVIOUS = "previous_response_id"


@dataclass(slots=True)
class ParamMap:
    """Where each chat message (and each of its tool calls) came from in the caller's request."""

    messages: list[str] = field(default_factory=list)
    calls: dict[tuple[int, int], str] = field(default_factory=dict)

    def _param(self, param: str) -> str:
        found = _MESSAGE_PARAM.match(param)
        if found is not None:
            index, call = int(found.group(1)), found.group(2)
            if call is not None and (index, int(call)) in self.calls:
                return self.calls[index, int(call)]
            return self.messages[index] if index < len(self.messages) else "input"
        param = _TOOL_PARAM.sub(r"tools[\1]", param)
        for old, new in _RENAMED:
            if param == old or param.startswith((f"{old}.", f"{old}[")):
                return new + param[len(old) :]
        return param

    def renamed(self, error: GatewayError) -> GatewayError:
        """`error` with its parameter (and the parameter's name in its message) the caller's."""
        if error.param is None:
            return error
        old, new = error.param, self._param(error.param)
        if new != old:
            error.param = new
            error.message = error.message.replace(old, new)
        return error


@dataclass(slots=True)
class _Messages:
    out: list[ChatMessage] = field(default_factory=list)
    params: ParamMap = field(default_factory=ParamMap)
    calls_made: set[str] = field(default_factory=set)
    # The last message is an assistant turn that later calls may join.
    open_turn: bool = False

    def add(self, message: ChatMessage, where: str, open_turn: bool = False) -> None:
        self.out.append(message)
        self.params.messages.append(where)
        self.open_turn = open_turn

    def item(self, item: Item, where: str) -> None:
        if isinstance(item, MessageItem):
            parts = [{"type": "text", "text": part.text} for part in item.content]
            assistant = item.role == "assistant"
            self.add(ChatMessage(role=item.role, content=parts), where, open_turn=assistant)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            if not self.open_turn:
                self.add(ChatMessage(role="assistant", tool_calls=[]), where, open_turn=True)
            turn = self.out[-1]
            turn.tool_calls = [*(turn.tool_calls or []), call]
            self.params.calls[len(self.out) - 1, len(turn.tool_calls) - 1] = where
            self.calls_made.add(item.call_id)
        else:
            self._output(item, where)

    def _output(self, item: FunctionCallOutputItem, where: str) -> None:
        if item.call_id not in self.calls_made:
            raise invalid_request(
                f"no function call with call_id '{item.call_id}' comes before this output",
                param=f"{where}.call_id",
            )
        self.add(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output), where)


def _tool(tool: object, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or kind != "function":
        raise invalid_request(
            f"tools of type {kind!r} are not supported by this gateway: built-in tools "
            "(web search, file search, code interpreter, MCP, ...) are not offered, only "
            "function tools {'type': 'function', 'name', 'parameters'}",
            param=f"{where}.type",
        )
    extra = sorted(set(tool) - _TOOL_KEYS)
    if extra:
        raise invalid_request(
            f"'{extra[0]}' is not supported on a function tool by this gateway",
            param=f"{where}.{extra[0]}",
        )
    function = {k: v for k, v in tool.items() if k != "type" and v is not None}
    return {"type": "function", "function": function}


def tool_choice(value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Chat's tool_choice for the Responses API's."""
    if value is None or isinstance(value, str):
        return value
    kind = value.get("type")
    if kind == "function":
        extra = sorted(set(value) - {"type", "name"})
        if extra:
            raise invalid_request(f"'{extra[0]}' is not supported here", f"tool_choice.{extra[0]}")
        return {"type": "function", "function": {"name": value.get("name")}}
    raise invalid_request(
        f"tool_choice of type {kind!r} is not supported by this gateway: 'none', 'auto', "
        "'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's response_format for `text` ({"format": ..., "verbosity": ...})."""
    if text is None:
        return None
    extra = sorted(set(text) - _TEXT_KEYS)
    if extra:
        raise invalid_request(f"'text.{extra[0]}' is not supported", param=f"text.{extra[0]}")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise invalid_request(
            f"text.verbosity {verbosity!r} is not supported: this gateway's models take no "
            "verbosity hint (only 'medium')",
            param="text.verbosity",
        )
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_request("text.format is an object with a type", param="text.format")
    if fmt.get("type") != "json_schema":
        return dict(fmt)
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def chat_request(
    req: ResponseCreateRequest, earlier: list[Item], items: list[Item]
) -> tuple[ChatCompletionRequest, ParamMap]:
    """The chat request a Responses request amounts to, and where its messages came from."""
    messages = _Messages()
    if req.instructions is not None:
        messages.add(ChatMessage(role="system", content=req.instructions), "instructions")
    for item in earlier:
        messages.item(item, PREVIOUS)
    for i, item in enumerate(items):
        messages.item(item, "input" if isinstance(req.input, str) else f"input[{i}]")
    tools = [_tool(tool, i) for i, tool in enumerate(req.tools)] if req.tools else None
    chat = ChatCompletionRequest(
        model=req.model,
        messages=messages.out,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=req.stream,
        user=req.user if req.user is not None else req.safety_identifier,
        response_format=response_format(req.text),
        tools=tools,
        tool_choice=tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        prompt_cache_key=req.prompt_cache_key,
        # One of chat's tiers: reject_unsupported let no other through.
        service_tier=cast(ServiceTier | None, req.service_tier),
    )
    return chat, messages.params
