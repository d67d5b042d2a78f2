"""Tool calling, the answer side: the calls a model wrote (in its tool-call format) found in its
answer, as `message.tool_calls` of a whole answer or as `tool_calls` deltas of a stream.

A call is a JSON object {"name", "arguments"} between the format's tags, naming one of the
request's functions. Anything else (text around calls, a block that does not parse or names
another function) stays content. `required` and named calls were constrained at the site, so
they always parse.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import msgspec

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

    @property
    def _begin(self) -> str:
        return self.parsing.begin.strip()

    @property
    def _end(self) -> str:
        return self.parsing.end.strip()

    def feed(self, text: str) -> list[str | ToolCall]:
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

    def flush(self) -> str:
        """What is left at the end (an unfinished call stays text)."""
        rest, self._pending = self._pending, ""
        return rest

    def _held_back(self, text: str) -> int:
        for length in range(min(len(text), len(self._begin) - 1), 0, -1):
            if self._begin.startswith(text[-length:]):
                return length
        return 0


def split_answer(text: str, parsing: ToolCallParsing) -> tuple[str | None, list[ToolCall]]:
    """A whole answer as (content, calls): content None when the answer is only calls."""
    scanner = ToolCallScanner(parsing)
    parts = [*scanner.feed(text), scanner.flush()]
    content = "".join(p for p in parts if isinstance(p, str))
    if scanner.calls and not content.strip():
        return None, scanner.calls
    return (content.strip() if scanner.calls else content), scanner.calls
