"""Tool-call arguments stream as the model writes them (issue 67): a call's first delta carries
its id and name, later ones fragments of its arguments, and what was streamed is the whole
answer's call; a call cut by max_tokens comes back as written with finish_reason "length"."""

from __future__ import annotations

import json

import pytest

from gateway.chat.tool_calls import CallDelta, Part, ToolCallScanner, split_finished
from gateway.dispatch.request import ToolCallParsing

BEGIN, END = "<tool_call>\n", "\n</tool_call>"
NAMES = frozenset({"get_weather", "get_time"})
AUTO = ToolCallParsing(BEGIN, END, NAMES)
NAMED = ToolCallParsing(BEGIN, END, NAMES, forced=True, named="get_weather")
REQUIRED = ToolCallParsing(BEGIN, END, NAMES, forced=True)
ARGUMENTS = '{"city": "Paris \\"la ville\\" {lumière}", "days": [1, {"x": 2}]}'
# As a forced call is written (its schema's keys sorted): arguments first.
SORTED = f'{BEGIN}{{"arguments": {ARGUMENTS}, "name": "get_weather"}}{END}'
NAME_FIRST = f'{BEGIN}{{"name": "get_weather", "arguments": {ARGUMENTS}}}{END}'


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def run(parsing: ToolCallParsing, chunks: list[str], reason: str = "stop") -> list[list[Part]]:
    """The parts each chunk gives, the end's last."""
    scanner = ToolCallScanner(parsing)
    out = [scanner.feed(chunk) for chunk in chunks]
    out.append(scanner.flush(reason))  # type: ignore[arg-type]
    return out


def deltas(parts: list[list[Part]]) -> list[CallDelta]:
    return [part for batch in parts for part in batch if isinstance(part, CallDelta)]


def test_a_named_call_begins_at_its_tag_and_its_arguments_follow_as_written() -> None:
    parts = run(NAMED, pieces(SORTED, 3))
    first_call = next(i for i, batch in enumerate(parts) if deltas([batch]))
    assert first_call <= len(BEGIN) // 3  # told at the opening tag, before any argument
    found = deltas(parts)
    assert (found[0].name, found[0].arguments) == ("get_weather", "")
    assert found[0].id is not None
    assert found[0].id.startswith("call_")
    fragments = [d.arguments for d in found[1:] if d.arguments]
    assert len(fragments) > 10  # piece by piece, not one piece at the end
    assert "".join(fragments) == ARGUMENTS
    assert all(d.id is None and d.name is None for d in found[1:])
    assert [d.last for d in found].count(True) == 1
    assert found[-1].last


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_streamed_calls_are_the_whole_answers(size: int) -> None:
    text = f"Let me see.\n{NAME_FIRST}\n{NAME_FIRST.replace('get_weather', 'get_time')}"
    whole = split_finished(text, AUTO, "stop")
    found = deltas(run(AUTO, pieces(text, size)))
    calls: dict[int, dict[str, str]] = {}
    for delta in found:
        call = calls.setdefault(delta.number, {"id": "", "name": "", "arguments": ""})
        call["id"] += delta.id or ""
        call["name"] += delta.name or ""
        call["arguments"] += delta.arguments
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.calls
    ]
    assert [c["id"] for c in calls.values()] != ["", ""]
    assert [c.function.arguments for c in whole.calls] == [ARGUMENTS, ARGUMENTS]
    assert whole.content == "Let me see."
    assert whole.finish_reason == "tool_calls"


def test_an_auto_call_begins_once_its_name_is_a_function_and_its_arguments_an_object() -> None:
    parts = run(AUTO, pieces(NAME_FIRST, 1))
    found = deltas(parts)
    begun = next(i for i, batch in enumerate(parts) if deltas([batch]))
    assert NAME_FIRST[: begun + 1].endswith('"arguments": {')
    assert (found[0].name, found[0].arguments, found[1].arguments) == ("get_weather", "", "{")
    # Another function's name, or arguments that are no object: content, as before.
    for text in (NAME_FIRST.replace("get_weather", "other"), f'{BEGIN}{{"name": "get_time", '
                 f'"arguments": "x"}}{END}'):  # fmt: skip
        assert not deltas(run(AUTO, pieces(text, 1)))
        assert split_finished(text, AUTO, "stop").content == text


def test_a_required_call_among_several_tools_begins_with_its_name() -> None:
    # Written arguments first: the name, hence the call, is known only after them.
    parts = run(REQUIRED, pieces(SORTED, 4))
    begun = next(batch for batch in parts if deltas([batch]))
    assert deltas([begun])[0].name == "get_weather"
    assert "".join(d.arguments for d in deltas([begun])) == ARGUMENTS


@pytest.mark.parametrize(
    ("parsing", "text", "name", "arguments"),
    [
        (NAMED, SORTED[:40], "get_weather", SORTED[SORTED.index('{"city"') : 40]),
        (REQUIRED, SORTED[:40], "", SORTED[SORTED.index('{"city"') : 40]),
        (AUTO, "Sure. " + NAME_FIRST[:60], "get_weather", NAME_FIRST[NAME_FIRST.index('{"c') : 60]),
    ],
)
def test_a_call_cut_by_max_tokens_comes_back_as_written(parsing, text, name, arguments) -> None:
    split = split_finished(text, parsing, "length")
    assert split.finish_reason == "length"
    ((call),) = split.calls
    assert (call.function.name, call.function.arguments) == (name, arguments)
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    streamed = deltas(run(parsing, pieces(text, 3), "length"))
    assert "".join(d.arguments for d in streamed) == arguments
    assert streamed[-1].last
    assert streamed[-1].cut
