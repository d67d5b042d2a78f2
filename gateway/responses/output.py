"""An answer's text as the Responses API's output items, and the stream events that build them.

One builder serves both forms of an answer: fed the site's text piece by piece, it opens an
assistant message at the first text, sends text deltas, closes the message when a function call
begins or the answer ends, and turns each call the model writes (gateway/chat/tool_calls.py finds
them) into a `function_call` item, its arguments sent as they are written. A whole answer is the
same run with its events dropped, so a streamed answer and a whole one have the same items.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.chat.tool_calls import CallDelta, Part, ToolCallScanner
from gateway.dispatch.request import ToolCallParsing
from gateway.responses.items import (
    FunctionCallItem,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputText,
    new_id,
)
from gateway.responses.result import ResponseObject


class LifecycleEvent(msgspec.Struct):
    """response.created / in_progress / completed / incomplete / failed."""

    type: str
    response: ResponseObject
    sequence_number: int = 0


class OutputItemEvent(msgspec.Struct):
    """response.output_item.added / done."""

    type: str
    output_index: int
    item: OutputItem
    sequence_number: int = 0


class ContentPartEvent(msgspec.Struct):
    """response.content_part.added / done."""

    type: str
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int = 0


class TextDeltaEvent(msgspec.Struct):
    item_id: str
    output_index: int
    delta: str
    content_index: int = 0
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: str = "response.output_text.delta"
    sequence_number: int = 0


class TextDoneEvent(msgspec.Struct):
    item_id: str
    output_index: int
    text: str
    content_index: int = 0
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: str = "response.output_text.done"
    sequence_number: int = 0


class ArgumentsDeltaEvent(msgspec.Struct):
    item_id: str
    output_index: int
    delta: str
    type: str = "response.function_call_arguments.delta"
    sequence_number: int = 0


class ArgumentsDoneEvent(msgspec.Struct):
    item_id: str
    output_index: int
    arguments: str
    type: str = "response.function_call_arguments.done"
    sequence_number: int = 0


class ErrorEvent(msgspec.Struct):
    message: str
    code: str | None = None
    param: str | None = None
    type: str = "error"
    sequence_number: int = 0


Event = (
    LifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
    | ArgumentsDeltaEvent | ArgumentsDoneEvent | ErrorEvent
)  # fmt: skip


@dataclass(slots=True)
class _OpenMessage:
    id: str
    index: int
    texts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _OpenCall:
    item: FunctionCallItem
    index: int
    arguments: list[str] = field(default_factory=list)


@dataclass(slots=True)
class OutputBuilder:
    """The output items of one answer, fed its text as it comes."""

    parsing: ToolCallParsing | None
    items: list[OutputItem] = field(default_factory=list)
    _scanner: ToolCallScanner | None = None
    _message: _OpenMessage | None = None
    _call: _OpenCall | None = None
    # With tools: whitespace that would open a message of nothing but the space between calls.
    _held: str = ""
    _calls: int = 0

    def __post_init__(self) -> None:
        if self.parsing is not None:
            self._scanner = ToolCallScanner(self.parsing)

    def feed(self, text: str) -> list[Event]:
        parts: list[Part] = self._scanner.feed(text) if self._scanner is not None else [text]
        return self._parts(parts)

    def _parts(self, parts: list[Part]) -> list[Event]:
        events: list[Event] = []
        for part in parts:
            events += self._text(part) if isinstance(part, str) else self._call_part(part)
        return events

    def finish(self, finish_reason: str | None) -> list[Event]:
        """The events that close the answer (an answer with neither text nor calls is one empty
        message, as chat's empty content)."""
        events: list[Event] = []
        if self._scanner is not None:
            cut = finish_reason == "length"
            events += self._parts(self._scanner.flush("length" if cut else "stop"))
        if self._message is None and not self._calls:
            events += self._open()
            events += self._text("")
        if self._message is not None:
            events += self._close(cut=finish_reason == "length")
        return events

    def _text(self, text: str) -> list[Event]:
        if self._scanner is not None and self._message is None and not (self._held + text).strip():
            self._held += text
            return []
        text, self._held = self._held + text, ""
        events: list[Event] = [] if self._message is not None or not text else self._open()
        if text and self._message is not None:
            self._message.texts.append(text)
            events.append(TextDeltaEvent(self._message.id, self._message.index, text))
        return events

    def _open(self) -> list[Event]:
        message = self._message = _OpenMessage(new_id("msg"), len(self.items))
        placeholder = MessageItem(message.id, "assistant", [], "in_progress")
        self.items.append(placeholder)
        return [
            OutputItemEvent("response.output_item.added", message.index, placeholder),
            ContentPartEvent(
                "response.content_part.added", message.id, message.index, 0, OutputText("")
            ),
        ]

    def _close(self, cut: bool = False) -> list[Event]:
        message, self._message = self._message, None
        assert message is not None
        text = "".join(message.texts)
        status: ItemStatus = "incomplete" if cut else "completed"
        item = MessageItem(message.id, "assistant", [OutputText(text)], status)
        self.items[message.index] = item
        return [
            TextDoneEvent(message.id, message.index, text),
            ContentPartEvent(
                "response.content_part.done", message.id, message.index, 0, OutputText(text)
            ),
            OutputItemEvent("response.output_item.done", message.index, item),
        ]

    def _call_part(self, part: CallDelta) -> list[Event]:
        events: list[Event] = []
        if part.id is not None:  # a call begins: an item of its own
            events += self._close() if self._message is not None else []
            self._held = ""
            self._calls += 1
            item = FunctionCallItem(new_id("fc"), part.id, part.name or "", "", "in_progress")
            self._call = _OpenCall(item, len(self.items))
            self.items.append(item)
            events.append(OutputItemEvent("response.output_item.added", self._call.index, item))
        call = self._call
        assert call is not None
        if part.arguments:
            call.arguments.append(part.arguments)
            events.append(ArgumentsDeltaEvent(call.item.id, call.index, part.arguments))
        if part.last:
            self._call = None
            arguments = "".join(call.arguments)
            status: ItemStatus = "incomplete" if part.cut else "completed"
            item = msgspec.structs.replace(call.item, arguments=arguments, status=status)
            self.items[call.index] = item
            events += [
                ArgumentsDoneEvent(item.id, call.index, arguments),
                OutputItemEvent("response.output_item.done", call.index, item),
            ]
        return events
