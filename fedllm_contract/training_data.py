"""OpenAI's chat fine-tuning format, line by line: the one check the gateway runs when a job is
made (gateway/fine_tuning/training_file.py) and the site runs when it starts the job
(site_engine/finetune/data.py), so that a file the gateway accepts is one the site trains on
(issue 58: a `tool` message or a raw U+2028 passed the gateway, then the site failed the job).

A file is UTF-8 JSONL: lines end at `\\n` only (a U+2028 inside a JSON string is text, as JSON
says, not a line break), the newline ending the last line is optional, and each line is a JSON
object `{"messages": [{"role": ..., "content": "..."}, ...]}` (`tools` and
`parallel_tool_calls` are allowed and not trained on). Roles are system, user and assistant:
the site renders each message with the chat template and learns the assistant's text, which a
`tool` message without its assistant's `tool_calls` cannot show. At least one assistant message
a line gives the loss something to learn. Every problem is the line's, never an exception: a
line that is not UTF-8 or nests past msgspec's depth is a bad line like any other.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

ROLES = ("system", "user", "assistant")
KEYS = frozenset({"messages", "tools", "parallel_tool_calls"})
# How many bad lines a refusal names (the count says how many more there are).
MAX_LISTED = 10

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class Line:
    """One line of the file: its number (1-based, as an editor shows it) and either its
    conversation or why it is none."""

    number: int
    messages: list[Message] | None
    problem: str | None = None


class TrainingFileError(ValueError):
    """The file cannot be trained on; the message names its first bad lines (at most
    MAX_LISTED), or says it holds no example."""


def lines(data: bytes) -> Iterator[Line]:
    """Every line of the file, checked: a conversation, or a problem naming what is wrong."""
    for number, line in enumerate(_split(data), start=1):
        messages, problem = _check(line) if line.strip() else (None, "an empty line")
        yield Line(number, messages, problem)
        # Hands the GIL over now if another thread waits for it (an event loop), rather than
        # when the interpreter's switch interval forces it.
        time.sleep(0)


def _split(data: bytes) -> Iterator[bytes]:
    """The file's lines, found one at a time: one split of 60 MiB holds the GIL long enough
    (0.2 to 1 s on a busy host) to stall the event loop of the process parsing it on a
    thread, and a line at a time lets the loop in between."""
    start, end = 0, len(data)
    while start < end:
        stop = data.find(b"\n", start)
        if stop < 0:
            stop = end
            if not data[start:].strip():
                return  # blanks after the newline that ends the last line
        yield data[start:stop]
        start = stop + 1


@dataclass(frozen=True, slots=True)
class Summary:
    examples: int
    # Characters of message content: a rough size of the file's text.
    content_chars: int


def check(data: bytes) -> Summary:
    """The file's size in examples; TrainingFileError naming the bad lines, or for no line."""
    return _read(data, None)


def conversations(data: bytes) -> list[list[Message]]:
    """The file's conversations; TrainingFileError naming the bad lines, or for no line."""
    found: list[list[Message]] = []
    _read(data, found)
    return found


def _read(data: bytes, keep: list[list[Message]] | None) -> Summary:
    problems: list[str] = []
    examples, bad, chars = 0, 0, 0
    for line in lines(data):
        if line.messages is not None:
            examples += 1
            chars += sum(len(message["content"]) for message in line.messages)
            if keep is not None:
                keep.append(line.messages)
            continue
        bad += 1
        if len(problems) < MAX_LISTED:
            problems.append(f"line {line.number}: {line.problem}")
    if bad:
        more = f"; and {bad - len(problems)} more" if bad > len(problems) else ""
        raise TrainingFileError(
            f"{bad} of the file's {bad + examples} lines are not chat training examples "
            f'({{"messages": [...]}} with an assistant message): {"; ".join(problems)}{more}'
        )
    if not examples:
        raise TrainingFileError("the file holds no training example")
    return Summary(examples, chars)


def _check(line: bytes) -> tuple[list[Message] | None, str | None]:
    try:
        example = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        return None, f"not JSON ({exc})"
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 (byte {exc.start} of the line)"
    except RecursionError:
        return None, "nested too deeply"
    if not isinstance(example, dict):
        return None, "not a JSON object"
    unknown = sorted(set(example) - KEYS)
    if unknown:
        return None, f"unknown field(s) {', '.join(unknown)}; expected 'messages'"
    given = example.get("messages")
    if not isinstance(given, list) or not given:
        return None, "'messages' must be a non-empty list"
    messages: list[Message] = []
    for index, message in enumerate(given):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            return None, f"{where} is not an object"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return None, f"{where}.role must be one of {', '.join(ROLES)}, not {role!r:.40}"
        if not isinstance(content, str):
            return None, f"{where}.content must be a string"
        messages.append({"role": role, "content": content})
    if not any(message["role"] == "assistant" for message in messages):
        return None, "no assistant message: nothing to learn from"
    return messages, None
