"""A chat request's messages as the model's chat template reads them.

Roles: system, developer (the template's own developer turn where it has one, else its system
turn, as OpenAI's newer SDKs and agent frameworks send it instead of system), user, assistant
(with earlier tool calls) and tool (a tool's answer); a legacy caller's assistant
`function_call` is a tool call and its `function` turn that call's answer. `name` is passed on
to the template. Content is plain text (a string, or text parts joined by newlines as vLLM
does); an assistant turn without content may carry its `refusal` text instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.chat.request import ChatMessage
from gateway.chat.tools import call_text, template_call
from gateway.errors import invalid_request
from gateway.federation import ToolCallFormat

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# What a text part may carry besides its text: OpenAI's cache breakpoint, a hint (ignored).
_TEXT_PART_KEYS = {"type", "text", "prompt_cache_breakpoint"}
Turn = dict[str, Any]
HERMES = ToolCallFormat()


@dataclass(frozen=True, slots=True)
class TemplateAbilities:
    """What the model's chat template renders itself (transformers' conventions)."""

    tools: bool = False  # reads `tools`, assistant `tool_calls` and `tool` turns
    developer: bool = False  # has a turn for the developer role


def content_text(message: ChatMessage, where: str, required: bool = True) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    if content is None:
        if not required:
            return ""
        raise invalid_request(f"{where}.content is required", param=f"{where}.content")
    texts = []
    for i, part in enumerate(content):
        param = f"{where}.content[{i}]"
        kind = part.get("type")
        if kind != "text":
            raise invalid_request(
                f"content parts of type {kind!r} are not supported: only 'text' parts", param=param
            )
        if not {"type", "text"} <= set(part) <= _TEXT_PART_KEYS or not isinstance(
            part["text"], str
        ):
            raise invalid_request(
                "a text part is {'type': 'text', 'text': <string>}, with an optional "
                "prompt_cache_breakpoint",
                param=param,
            )
        texts.append(part["text"])
    # Parts are joined with newlines, as vLLM does, so that separate paragraphs stay separate.
    return "\n".join(texts)


def _check(message: ChatMessage, where: str) -> None:
    if message.role not in ROLES:
        raise invalid_request(
            f"role {message.role!r} is not supported: use one of {', '.join(ROLES)}",
            param=f"{where}.role",
        )
    if message.audio is not None:
        raise invalid_request(
            "'audio' on messages is not supported by this gateway: the models here are text-only",
            param=f"{where}.audio",
        )
    for name in ("tool_calls", "function_call", "refusal"):
        if getattr(message, name) is not None and message.role != "assistant":
            raise invalid_request(f"only assistant messages carry {name}", f"{where}.{name}")
    if message.role == "tool" and message.tool_call_id is None:
        raise invalid_request(
            "a tool message names the call it answers", param=f"{where}.tool_call_id"
        )
    if message.role == "function" and message.name is None:
        raise invalid_request(
            "a function message names the function that answered", param=f"{where}.name"
        )


def _turn(
    message: ChatMessage, where: str, abilities: TemplateAbilities, fmt: ToolCallFormat
) -> Turn:
    calls: list[object] = list(message.tool_calls or [])
    if message.function_call is not None:
        calls.append({"type": "function", "function": message.function_call})
    # A turn of calls, a refusal, or a function's answer (null for no output) may lack content.
    needs_content = not calls and message.refusal is None and message.role != "function"
    text = content_text(message, where, required=needs_content)
    if not text and message.refusal is not None:
        text = message.refusal
    role = message.role
    if role == "developer" and not abilities.developer:
        role = "system"
    if role == "function":  # a legacy call's answer: a tool turn
        role = "tool"
    turn: Turn = {"role": role, "content": text}
    if message.name is not None:
        turn["name"] = message.name
    if abilities.tools:
        if calls:
            turn["tool_calls"] = [
                template_call(call, _call_where(message, where, i)) for i, call in enumerate(calls)
            ]
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        return turn
    if calls:
        written = [
            call_text(call, _call_where(message, where, i), fmt) for i, call in enumerate(calls)
        ]
        turn["content"] = "\n".join(filter(None, [text, *written]))
    if role == "tool":  # a template without tool turns: the result comes back as a user turn
        turn = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    return turn


def _call_where(message: ChatMessage, where: str, index: int) -> str:
    """Where the message's call number `index` was sent (its legacy function_call comes last)."""
    if index == len(message.tool_calls or []):
        return f"{where}.function_call"
    return f"{where}.tool_calls[{index}]"


def conversation(
    messages: list[ChatMessage],
    abilities: TemplateAbilities | None = None,
    fmt: ToolCallFormat = HERMES,
    tools_text: str | None = None,
) -> list[Turn]:
    """The messages as the template reads them; `tools_text` (tools shown to a template without
    tool support) joins the system turn, which is added first if there is none."""
    if not messages:
        raise invalid_request("messages must hold at least one message", param="messages")
    abilities = abilities or TemplateAbilities()
    turns: list[Turn] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        _check(message, where)
        turn = _turn(message, where, abilities, fmt)
        last = turns[-1] if turns else None
        tool_results = message.role in ("tool", "function") and not abilities.tools
        if tool_results and last is not None and last.get("tool_results"):
            last["content"] += "\n" + turn["content"]  # answers to one turn's calls: one turn
            continue
        if tool_results:
            turn["tool_results"] = True
        turns.append(turn)
    for turn in turns:
        turn.pop("tool_results", None)
    if tools_text:
        if turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{tools_text}".strip()
        else:
            turns.insert(0, {"role": "system", "content": tools_text})
    return turns
