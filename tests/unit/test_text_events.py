"""gateway/api/openai_format.py's _TextEvents: a common chunk's event, made from the bytes around
its text, is byte for byte the event of the chunk's object encoded whole (completions and chat,
with and without usage, any text)."""

from __future__ import annotations

import random

import pytest

from fedllm_contract.priority import Priority
from fedllm_contract.request_options import RequestOptions
from gateway.api.chat_schemas import ChatChunkChoice, ChatDelta
from gateway.api.openai_format import _chat_chunk, _chunk, _event, _TextEvents
from gateway.completions.result import CompletionChoice
from gateway.dispatch.request import PreparedCompletion
from gateway.sites.interface import GenerateParams

TEXTS = [
    "",
    " hello",
    'quote " backslash \\ slash /',
    "line\nbreak\ttab\r",
    "emoji 😀🎉 and accents éà",
    "\x00\x01\x1f control",
    "\u2028\u2029 separators",
    "\x01fedllm-text\x01",  # the mark itself, as an answer's text
]


def _prepared(include_usage: bool, priority: Priority, adapter: str | None) -> PreparedCompletion:
    options = RequestOptions(adapter=adapter, priority=priority)
    params = GenerateParams("cmpl-1f2e", (1, 2, 3), 16, options=options)
    return PreparedCompletion("cmpl-1f2e", 1764000000, "tiny", params, True, include_usage,
                              None, "hi")  # fmt: skip


def _random_texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = 'ab "\\/\n\t\x00\x7f\u00e9\u2028😀{}[]:,'
    return ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30))) for _ in range(200)]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize(
    ("priority", "adapter"), [(Priority.INTERACTIVE, None), (Priority.FLEX, "lora-a")]
)
def test_a_text_event_is_the_encoded_chunk(
    include_usage: bool, priority: Priority, adapter: str | None
) -> None:
    prepared = _prepared(include_usage, priority, adapter)

    def completion(index: int, text: str) -> object:
        return _chunk(prepared, [CompletionChoice(text, index)])

    def chat(index: int, text: str) -> object:
        return _chat_chunk(prepared, [ChatChunkChoice(ChatDelta(content=text), index=index)])

    for build in (completion, chat):
        events = _TextEvents(build)  # type: ignore[arg-type]
        for index in (0, 3):
            for text in TEXTS + _random_texts(index):
                assert events.event(index, text) == _event(build(index, text))  # type: ignore[arg-type]


def test_an_id_holding_the_mark_falls_back_to_encoding_whole() -> None:
    prepared = _prepared(False, Priority.INTERACTIVE, "\x01fedllm-text\x01")

    def completion(index: int, text: str) -> object:
        return _chunk(prepared, [CompletionChoice(text, index)])

    events = _TextEvents(completion)  # type: ignore[arg-type]
    assert events.event(0, "x") == _event(completion(0, "x"))  # type: ignore[arg-type]
