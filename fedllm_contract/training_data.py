"""OpenAI's chat fine-tuning format, line by line: the one check the gateway runs when a job is
made (gateway/fine_tuning/file_check.py) and the site runs when it starts the job
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

A caller may add a check of its own to every good line (`extra`: the gateway's refusal of a line
longer than the model's context, fedllm_contract/training_tokens.py), and is asked every
STOP_EVERY lines whether the read is to stop (`stop`: a site's job cancelled while its file is
read; the gateway's checking process holds its share of the CPU there). Nothing here yields to
other threads line by line: a per-line yield multiplied a read's wall time under load (issue 67:
150 s for 20 MiB).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec

ROLES = ("system", "user", "assistant")
KEYS = frozenset({"messages", "tools", "parallel_tool_calls"})
# How many bad lines a refusal names (the count says how many more there are).
MAX_LISTED = 10


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


# How many lines a read goes between two looks at its `stop` (a look costs a call).
STOP_EVERY = 256

Message = dict[str, str]
# A caller's own check of a good line: a problem naming what is wrong, or None.
LineCheck = Callable[[list[Message]], str | None]


class Stopped(Exception):
    """The read was told to stop (`stop` said so) before it reached the file's end."""


def lines(
    data: bytes, extra: LineCheck | None = None, stop: Callable[[], bool] | None = None
) -> Iterator[Line]:
    """Every line of the file, checked: a conversation, or a problem naming what is wrong.
    Stopped when `stop` says so (looked at every STOP_EVERY lines)."""
    for number, line in enumerate(_split(data), start=1):
        if stop is not None and number % STOP_EVERY == 0 and stop():
            raise Stopped(f"stopped at line {number}")
        messages, problem = _check(line) if line.strip() else (None, "an empty line")
        if messages is not None and extra is not None:
            problem = extra(messages)
            messages = messages if problem is None else None
        yield Line(number, messages, problem)


def _split(data: bytes) -> Iterator[bytes]:
    """The file's lines, found one at a time: one split of 60 MiB holds the GIL long enough
    (0.2 to 1 s on a busy host) to stall the event loop of a site parsing it on a thread, and
    a line at a time lets the loop in between."""
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


def check(
    data: bytes, extra: LineCheck | None = None, stop: Callable[[], bool] | None = None
) -> Summary:
    """The file's size in examples; TrainingFileError naming the bad lines (those `extra`
    finds too), or for no line; Stopped when `stop` says so."""
    return _read(data, None, extra, stop)


def conversations(data: bytes, stop: Callable[[], bool] | None = None) -> list[list[Message]]:
    """The file's conversations; TrainingFileError naming the bad lines, or for no line;
    Stopped when `stop` says so."""
    found: list[list[Message]] = []
    _read(data, found, None, stop)
    return found


def _read(
    data: bytes,
    keep: list[list[Message]] | None,
    extra: LineCheck | None,
    stop: Callable[[], bool] | None,
) -> Summary:
    problems: list[str] = []
    examples, bad, chars = 0, 0, 0
    for line in lines(data, extra, stop):
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
