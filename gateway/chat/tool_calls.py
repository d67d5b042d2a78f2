"""Tool calling, the answer side: the calls a model wrote (in its tool-call format) found in its
answer, as `message.tool_calls` of a whole answer or as `tool_calls` deltas of a stream.

A call is a JSON object {"name", "arguments"} between the format's tags, naming one of the
request's functions. Its arguments go out as the model writes them, as OpenAI streams them: the
call's first delta carries its id and function name, the next ones fragments of its arguments'
JSON text. So a call begins once it is known to be one:
- in a forced answer (`tool_choice` required or named: calls only, constrained at the site), at
  its opening tag when the function is known beforehand (a named choice, or a single tool),
  else once the model has written the name;
- with `auto`, once the name is one of the request's functions and the arguments have begun
  as an object.
A block that never began a call (it does not parse, names another function, its arguments are
no object) stays content, as written, with two exceptions, so that the model's call markup
never reaches a client as text: none of a forced answer is content, and markup cut by
`max_tokens` before a call began is dropped.

A begun call is a call, whole or streamed alike (what was streamed is never taken back): its
arguments are the text the model wrote for them. One cut by `max_tokens` comes back with what
was written of it (its arguments' JSON unfinished) and finish_reason "length", as OpenAI
answers; its name is "" if the model had not written it yet (a `required` call among several
tools: the call's schema is sent with its keys sorted, so `arguments` comes first).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import msgspec

from gateway.chat.call_body import ARGUMENT_KEYS, CallBody
from gateway.completions.result import FinishReason
from gateway.dispatch.request import ToolCallParsing


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of the answer's call number `number`: its first carries the call's id and name,
    each a fragment of its arguments' text; `last` closes the call (`cut` by max_tokens)."""

    number: int
    arguments: str
    id: str | None = None
    name: str | None = None
    last: bool = False
    cut: bool = False


Part = str | CallDelta


def _parsed_call(body: CallBody, parsing: ToolCallParsing) -> tuple[str, str] | None:
    """A whole block that never began a call, read whole as before: (name, arguments text) if
    it is a call of the request's functions."""
    try:
        value = json.loads(body.text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in parsing.names:
        return None
    key = next((k for k in ARGUMENT_KEYS if k in value), None)
    arguments = value[key] if key is not None else {}
    if not isinstance(arguments, dict):
        return None
    # The text the model wrote for them, where the reader found it (it parses: the block did).
    written = body.arguments_so_far() if body.arguments_end is not None else ""
    return str(value["name"]), written or json.dumps(arguments)


@dataclass(slots=True)
class ToolCallScanner:
    """Finds calls in an answer fed piece by piece: `feed` returns what can be told apart so
    far, as content text and call deltas in order; text that may still begin a call (or end
    one) is held back until it can be told."""

    parsing: ToolCallParsing
    calls: list[ToolCall] = field(default_factory=list)
    # The answer ended at max_tokens inside markup that began no call, which was dropped.
    cut: bool = False
    # The answer ended at max_tokens inside a call, which is returned as written so far.
    cut_call: bool = False
    _pending: str = ""
    _body: CallBody | None = None  # inside a call's tags
    _call: ToolCall | None = None  # the call being written, once begun
    _sent: int = 0  # of its arguments' text

    @property
    def _begin(self) -> str:
        return self.parsing.begin.strip()

    @property
    def _end(self) -> str:
        return self.parsing.end.strip()

    def feed(self, text: str) -> list[Part]:
        self._pending += text
        out: list[Part] = []
        while self._pending:
            if self._body is None:
                if not self._outside(out):
                    break
            elif not self._inside(out):
                break
        return out

    def _outside(self, out: list[Part]) -> bool:
        start = self._pending.find(self._begin)
        if start < 0:
            ready = self._pending[: len(self._pending) - _held(self._pending, self._begin)]
            self._content(ready, out)
            self._pending = self._pending[len(ready) :]
            return False
        self._content(self._pending[:start], out)
        self._pending = self._pending[start + len(self._begin) :]
        self._body = CallBody()
        if self.parsing.named is not None:
            out.append(self._open(self.parsing.named))
        return True

    def _inside(self, out: list[Part]) -> bool:
        assert self._body is not None
        stop = self._pending.find(self._end)
        if stop < 0:
            ready = self._pending[: len(self._pending) - _held(self._pending, self._end)]
            self._body.feed(ready)
            self._pending = self._pending[len(ready) :]
            self._progress(out)
            return False
        self._body.feed(self._pending[:stop])
        self._pending = self._pending[stop + len(self._end) :]
        self._close(out, whole=True)
        return True

    def _content(self, text: str, out: list[Part]) -> None:
        if text and not self.parsing.forced:  # a forced answer's separators are no content
            out.append(text)

    def _open(self, name: str) -> CallDelta:
        self._call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", FunctionCall(name, ""))
        self._sent = 0
        self.calls.append(self._call)
        return CallDelta(len(self.calls) - 1, "", self._call.id, name)

    def _progress(self, out: list[Part]) -> None:
        """Begins the call once it is known to be one, then sends its new arguments text."""
        body = self._body
        assert body is not None
        if self._call is None:
            named = body.name is not None and body.name in self.parsing.names
            if not (named and body.arguments_begun):
                return
            assert body.name is not None
            out.append(self._open(body.name))
        written = body.arguments_so_far()
        if len(written) > self._sent:
            fragment, self._sent = written[self._sent :], len(written)
            assert self._call is not None
            self._call.function.arguments += fragment
            out.append(CallDelta(len(self.calls) - 1, fragment))

    def _close(self, out: list[Part], whole: bool, cut: bool = False) -> None:
        """The block ends: `whole` at its closing tag, else where the answer ended (`cut` by
        max_tokens)."""
        body = self._body
        assert body is not None
        self._progress(out)  # it may be known to be a call only now
        if self._call is None and not cut and (found := _parsed_call(body, self.parsing)):
            name, arguments = found
            out.append(self._open(name))
            body = CallBody(arguments, arguments_start=0, arguments_end=len(arguments))
        elif (
            self._call is None
            and cut
            and body.name in (None, *self.parsing.names)
            and (body.name is not None or body.arguments_begun)
        ):
            # Cut by max_tokens once the model had written the function's name or begun the
            # arguments: what was written is returned.
            out.append(self._open(body.name or ""))
        self._body = None
        if self._call is None:  # no call: the block as the model wrote it
            self.cut = self.cut or cut
            if not cut:
                self._content(f"{self._begin}{body.text}{self._end if whole else ''}", out)
            return
        self._body = body
        self._progress(out)
        self._body = None
        if self._call.function.arguments == "" and not cut:
            self._call.function.arguments = "{}"  # a call without arguments takes none
            out.append(CallDelta(len(self.calls) - 1, "{}"))
        self.cut_call = self.cut_call or cut
        out.append(CallDelta(len(self.calls) - 1, "", last=True, cut=cut))
        self._call = None

    def flush(self, reason: FinishReason | None = None) -> list[Part]:
        """What is left at the end. A call being written ends there (cut by max_tokens:
        `reason` "length"). Held-back text is markup that began no call: cut by max_tokens, or
        in a forced answer, it is dropped; an answer the model itself ended there keeps it as
        text."""
        out: list[Part] = []
        rest, self._pending = self._pending, ""
        if self._body is not None:
            self._body.feed(rest)
            self._close(out, whole=False, cut=reason == "length")
            return out
        if rest and reason == "length":
            self.cut = True
        elif rest:
            self._content(rest, out)
        return out

    def finish_reason(self, reason: FinishReason | None) -> FinishReason | None:
        """The answer's finish reason: "length" when a call was cut; "tool_calls"
        ("function_call" for a legacy caller) when it called any and ended there, or was cut
        in markup after them."""
        if self.cut_call:
            return "length"
        if not self.calls or not (reason == "stop" or (reason == "length" and self.cut)):
            return reason
        return "function_call" if self.parsing.legacy_functions else "tool_calls"


def _held(text: str, tag: str) -> int:
    """How much of `text`'s end may be the beginning of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
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
    parts = [*scanner.feed(text), *scanner.flush(reason)]
    content: str | None = "".join(p for p in parts if isinstance(p, str))
    if scanner.calls or parsing.forced or scanner.cut:
        content = (content or "").strip() or None
    return SplitAnswer(content, scanner.calls, scanner.finish_reason(reason))


def split_answer(text: str, parsing: ToolCallParsing) -> tuple[str | None, list[ToolCall]]:
    """A whole answer as (content, calls): content None when the answer is only calls."""
    split = split_finished(text, parsing, None)
    return split.content, split.calls
