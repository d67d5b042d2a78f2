"""The JSON object of one tool call (`{"name": ..., "arguments": {...}}`) read as the model
writes it, character by character: which function it names once that string is whole, and
where its arguments object begins and ends in the text, so that the arguments can go to the
client as they are written (gateway/chat/tool_calls.py).

Only the call object's own keys are read; what is inside the arguments is followed only as far
as strings, escapes and nesting go, to find where the arguments end. Malformed text is never an
error here: the reader just learns less (no name, no arguments), and the caller decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes' key, and the one some models write
_Expect = Literal["object", "key", "colon", "value", "comma", "done"]


@dataclass(slots=True)
class CallBody:
    """The text between a call's tags, read as it grows (`feed`)."""

    text: str = ""
    # The function the call names, once its string is whole.
    name: str | None = None
    # Where the arguments object begins in `text`, and ends (just past its closing brace).
    arguments_start: int | None = None
    arguments_end: int | None = None
    # The arguments key's value is something other than an object: not a call.
    arguments_invalid: bool = False
    _expect: _Expect = "object"
    _depth: int = 0  # nesting, the call object itself being 1
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = 0
    _key: str | None = None
    _in_arguments: bool = False

    def feed(self, text: str) -> None:
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            self._read(i, self.text[i])

    @property
    def arguments_begun(self) -> bool:
        return self.arguments_start is not None

    def arguments_so_far(self) -> str:
        """The arguments text written so far (all of it once whole)."""
        if self.arguments_start is None:
            return ""
        end = self.arguments_end if self.arguments_end is not None else len(self.text)
        return self.text[self.arguments_start : end]

    def _read(self, i: int, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_ended(i)
            return
        if char == '"':
            self._in_string, self._string_start = True, i
            if self._depth == 1 and self._expect == "value":
                self._value_begins(i, char)
            return
        if self._depth == 0:
            if char == "{" and self._expect == "object":
                self._depth, self._expect = 1, "key"
            return
        if self._depth > 1:
            self._nested(i, char)
            return
        if char == ":" and self._expect == "colon":
            self._expect = "value"
        elif char == "," and self._expect == "comma":
            self._expect = "key"
        elif char == "}":
            self._depth, self._expect = 0, "done"
        elif char in "{[":
            if self._expect == "value":
                self._value_begins(i, char)
            self._depth += 1
        elif not char.isspace() and self._expect == "value":
            self._value_begins(i, char)
            self._expect = "comma"

    def _nested(self, i: int, char: str) -> None:
        if char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 1:
                if self._in_arguments:
                    self.arguments_end, self._in_arguments = i + 1, False
                self._expect = "comma"

    def _value_begins(self, i: int, char: str) -> None:
        if self._key not in ARGUMENT_KEYS or self.arguments_begun or self.arguments_invalid:
            return
        if char == "{":
            self.arguments_start, self._in_arguments = i, True
        else:
            self.arguments_invalid = True

    def _string_ended(self, i: int) -> None:
        try:
            value = json.loads(self.text[self._string_start : i + 1])
        except ValueError:
            value = None
        if self._expect == "key":
            self._key = value if isinstance(value, str) else None
            self._expect = "colon"
        elif self._expect == "value":
            if self._key == "name" and isinstance(value, str) and self.name is None:
                self.name = value
            self._expect = "comma"
