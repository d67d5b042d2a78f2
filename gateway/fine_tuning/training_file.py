"""OpenAI's chat fine-tuning format, checked line by line when a job is created: each line a
JSON object `{"messages": [{"role": ..., "content": "..."}, ...]}` (optionally `tools` and
`parallel_tool_calls`), roles system, user, assistant or tool, every content a string, and at
least one assistant message to learn from. A file with any bad line is refused whole, naming
the first lines at fault and why, so that a tenant fixes them all at once."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from gateway.errors import GatewayError, invalid_request

ROLES = frozenset({"system", "user", "assistant", "tool"})
_KEYS = frozenset({"messages", "tools", "parallel_tool_calls"})
# How many bad lines an error names (the count says how many more there are).
MAX_LISTED = 10


@dataclass(frozen=True, slots=True)
class TrainingFile:
    examples: int
    # Characters of message content: a rough size, for the resolved batch size.
    content_chars: int


def _line_problem(line: bytes) -> tuple[str | None, int]:
    """Why the line is not a training example (None: it is one), and its content's characters."""
    try:
        example = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        return f"not JSON ({exc})", 0
    if not isinstance(example, dict):
        return "not a JSON object", 0
    unknown = sorted(set(example) - _KEYS)
    if unknown:
        return f"unknown field(s) {', '.join(unknown)}; expected 'messages'", 0
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list", 0
    chars, answers = 0, 0
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            return f"{where} is not an object", 0
        role = message.get("role")
        if role not in ROLES:
            return f"{where}.role must be one of {', '.join(sorted(ROLES))}, not {role!r}", 0
        content = message.get("content")
        if not isinstance(content, str):
            return f"{where}.content must be a string", 0
        chars += len(content)
        answers += role == "assistant"
    if not answers:
        return "no assistant message: nothing to learn from", 0
    return None, chars


def check_training_file(content: bytes, param: str) -> TrainingFile:
    """The file's examples; 400 (`param` at fault, code invalid_training_file) listing the first
    MAX_LISTED bad lines by number (1-based, as an editor shows them) for any bad line or an
    empty file."""
    lines = content.split(b"\n")
    if lines and not lines[-1].strip():
        lines.pop()  # the newline that ends the last line
    problems: list[str] = []
    bad, chars = 0, 0
    for number, line in enumerate(lines, start=1):
        problem, line_chars = _line_problem(line) if line.strip() else ("an empty line", 0)
        chars += line_chars
        if problem is not None:
            bad += 1
            if len(problems) < MAX_LISTED:
                problems.append(f"line {number}: {problem}")
    if not lines:
        raise _invalid("the file holds no training example", param)
    if bad:
        more = f"; and {bad - len(problems)} more" if bad > len(problems) else ""
        raise _invalid(
            f"{bad} of the file's {len(lines)} lines are not chat training examples "
            f'({{"messages": [...]}} with an assistant message): {"; ".join(problems)}{more}',
            param,
        )
    return TrainingFile(len(lines), chars)


def _invalid(message: str, param: str) -> GatewayError:
    return invalid_request(message, param=param, code="invalid_training_file")
