from __future__ import annotations

from pathlib import Path

import pytest

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Unicode: héllo wörld — 東京 🚀 done",
    "  leading spaces and\nnew lines\n\n",
]


@pytest.fixture(scope="module")
def tokenizer(gpt2_tokenizer_dir: Path):
    return load_tokenizer(gpt2_tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([token]) for token in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The answer is 42. END and more", ("END",), "The answer is 42. "),
        ("abc###def", ("##", "c#"), "ab"),  # the earliest stop wins
        ("no stop here", ("zzz",), "no stop here"),
        ("line one\nline two", ("\n",), "line one"),
        ("ends with a partial sto", ("stop",), "ends with a partial sto"),  # flushed at the end
    ],
)
def test_stop_strings_cut_the_text(tokenizer, text: str, stop, expected: str) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    released = "".join(detok.push([token]) for token in tokenizer.encode(text)) + detok.flush()
    assert released == expected == detok.text
    assert detok.stopped == (expected != text)


def test_nothing_is_released_after_a_stop(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("b",))
    detok.push(tokenizer.encode("a b"))
    assert detok.stopped
    assert detok.push(tokenizer.encode(" c d")) == ""


def test_a_possible_stop_prefix_is_held_back_until_resolved(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=("END",))
    assert detok.push(tokenizer.encode("done E")) == "done "
    assert detok.push(tokenizer.encode("ither")) == "Either"


@pytest.mark.parametrize("stop", [(), ("zzz",)])
def test_an_answer_cut_inside_a_character_keeps_what_its_bytes_say(tokenizer, stop) -> None:
    """Issue 75: max_tokens cut after " \\xf0\\x9f" and "\\x8e" (the first three bytes of 🎉): the
    text ended before the emoji and lost the space before it too, while the logprobs' bytes said
    both. The end of the answer releases them: the space, and U+FFFD for the cut character, as
    the bytes joined read with errors="replace"."""
    ids = tokenizer.encode("Say 🎉.")[:3]  # "Say", " \xf0\x9f", "\x8e"
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    released = "".join(detok.push([token]) for token in ids)
    assert released == "Say"  # a partial character is held while more may come
    released += detok.flush()
    assert released == "Say \ufffd" == detok.text
    assert released == tokenizer.decode(ids)
