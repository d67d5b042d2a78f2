"""Tool calling, the answer side: the calls a model wrote (in its tool-call format) found in its
answer, as `message.tool_calls` of a whole answer or as `tool_calls` deltas of a stream.

A call is a JSON object {"name", "arguments"} between the format's tags, naming one of the
request's functions. Anything else (text around calls, a block that does not parse or names
another function) stays content, with two exceptions, so that the model's call markup never
reaches a client as text:
- a forced answer (`tool_choice` required or named) is nothing but calls, constrained at the
  site: none of it is content;
- an answer cut by `max_tokens` inside a call (or inside what may begin one) drops that
  unfinished call. The calls completed before it are the answer, with finish_reason
  "tool_calls"; cut before any call completed, the answer is finish_reason "length" with
  neither content nor calls from the markup.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import msgspec

from gateway.completions.result import FinishReason
from gateway.dispatch.request import ToolCallParsing


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


def _call(body: str, parsing: ToolCallParsing) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in parsing.names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    return ToolCall(call_id, FunctionCall(str(value["name"]), json.dumps(arguments)))


@dataclass(slots=True)
class ToolCallScanner:
    """Finds calls in an answer fed piece by piece: `feed` returns what can be told apart so
    far, as content text and complete calls in order; text that may still begin a call is held
    back until it can be told."""

    parsing: ToolCallParsing
    _pending: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    # The answer ended inside a call's markup, which was dropped (see flush).
    cut: bool = False

    @property
    def _begin(self) -> str:
        return self.parsing.begin.strip()

    @property
    def _end(self) -> str:
        return self.parsing.end.strip()

    def feed(self, text: str) -> list[str | ToolCall]:
        parts = self._scan(text)
        if self.parsing.forced:  # only calls: the separators between them are no content
            return [part for part in parts if isinstance(part, ToolCall)]
        return parts

    def _scan(self, text: str) -> list[str | ToolCall]:
        self._pending += text
        out: list[str | ToolCall] = []
        while self._pending:
            start = self._pending.find(self._begin)
            if start < 0:
                held = self._held_back(self._pending)
                ready = self._pending[: len(self._pending) - held]
                if ready:
                    out.append(ready)
                self._pending = self._pending[len(ready) :]
                break
            if start:
                out.append(self._pending[:start])
                self._pending = self._pending[start:]
            stop = self._pending.find(self._end, len(self._begin))
            if stop < 0:
                break  # a call still being written
            block = self._pending[: stop + len(self._end)]
            self._pending = self._pending[len(block) :]
            call = _call(block[len(self._begin) : stop].strip(), self.parsing)
            if call is None:
                out.append(block)
            else:
                self.calls.append(call)
                out.append(call)
        return out

    def flush(self, reason: FinishReason | None = None) -> str:
        """What is left at the end, as content. What is held back then is an unfinished call,
        or text that may begin one: cut by max_tokens (`reason` "length"), or in a forced
        answer, it is markup and dropped; an answer the model itself ended there keeps it as
        text."""
        rest, self._pending = self._pending, ""
        if self.parsing.forced or (rest and reason == "length"):
            self.cut = reason == "length"
            return ""
        return rest

    def finish_reason(self, reason: FinishReason | None) -> FinishReason | None:
        """The answer's finish reason: "tool_calls" ("function_call" for a legacy caller) when
        it called any and ended there, or was cut inside the call after them."""
        if not self.calls or not (reason == "stop" or (reason == "length" and self.cut)):
            return reason
        return "function_call" if self.parsing.legacy_functions else "tool_calls"

    def _held_back(self, text: str) -> int:
        for length in range(min(len(text), len(self._begin) - 1), 0, -1):
            if self._begin.startswith(text[-length:]):
                return length
        return 0


@dataclass(frozen=True, slots=True)
class SplitAnswer:
    content: str | None  # None when the answer is only calls
    calls: list[ToolCall]
    finish_reason: FinishReason | None


def split_finished(text: str, parsing: ToolCallParsing, reason: FinishReason | None) -> SplitAnswer:
    """A whole answer that ended for `reason`, as content, calls and its finish reason."""
    scanner = ToolCallScanner(parsing)
    parts = [*scanner.feed(text), scanner.flush(reason)]
    content: str | None = "".join(p for p in parts if isinstance(p, str))
    if scanner.calls or parsing.forced or scanner.cut:
        content = (content or "").strip() or None
    return SplitAnswer(content, scanner.calls, scanner.finish_reason(reason))


def split_answer(text: str, parsing: ToolCallParsing) -> tuple[str | None, list[ToolCall]]:
    """A whole answer as (content, calls): content None when the answer is only calls."""
    split = split_finished(text, parsing, None)
    return split.content, split.calls
