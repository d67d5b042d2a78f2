"""The legacy function-calling fields (`functions`, `function_call`), which OpenAI deprecated for
`tools` and `tool_choice` but still serves, mapped onto those: each function is a tool, the
call choice a tool choice, and the answer goes back in the legacy shape (`message.function_call`,
finish_reason "function_call"; gateway/chat/result.py). A legacy answer holds one call, so
parallel calls are off. Errors name the legacy fields the client sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gateway.chat.request import ChatCompletionRequest
from gateway.errors import GatewayError, InvalidRequest, invalid_request

_TOOL_PARAM = re.compile(r"^tools\[(\d+)\](?:\.function)?")


@dataclass(frozen=True, slots=True)
class ToolFields:
    """A request's tool fields, in the current API's terms."""

    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel: bool | None
    legacy: bool = False  # they came as `functions`: answer in the legacy shape


def tool_fields(req: ChatCompletionRequest) -> ToolFields:
    """The request's tools and tool choice, its legacy functions mapped onto them."""
    if req.functions is None:
        if req.function_call is not None:
            raise invalid_request(
                "function_call chooses among functions: send functions with it (or tools "
                "with tool_choice)",
                param="function_call",
            )
        return ToolFields(req.tools, req.tool_choice, req.parallel_tool_calls)
    for param in ("tools", "tool_choice"):
        if getattr(req, param) is not None:
            raise invalid_request(
                f"send either functions (legacy) or {param}, not both", param="functions"
            )
    tools = [{"type": "function", "function": function} for function in req.functions]
    return ToolFields(tools, _tool_choice(req.function_call), parallel=False, legacy=True)


def _tool_choice(function_call: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if function_call is None or function_call in ("none", "auto"):
        return function_call
    if isinstance(function_call, dict) and set(function_call) == {"name"}:
        return {"type": "function", "function": {"name": function_call["name"]}}
    raise invalid_request(
        "function_call is 'none', 'auto' or {'name': <a function's name>}", param="function_call"
    )


def legacy_error(exc: GatewayError) -> GatewayError:
    """A tool check's error, naming the legacy field it was sent as (`tools[1].function.name`
    is `functions[1].name`, `tool_choice` is `function_call`)."""
    param = exc.param
    if not isinstance(exc, InvalidRequest) or param is None:
        return exc
    if param == "tool_choice":
        renamed = "function_call"
    else:
        renamed = _TOOL_PARAM.sub(lambda m: f"functions[{m.group(1)}]", param)
    message = exc.message.replace("tool_choice", "function_call")
    return invalid_request(message, param=renamed, code=exc.code)
