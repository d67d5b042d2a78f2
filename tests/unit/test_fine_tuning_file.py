"""The fine-tuning API's parts that need no database (issue 54): a chat training file checked
line by line, the hyperparameters' "auto", and the model name a succeeded job is served under
(that model's privacy: tests/unit/test_adapter_models.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from gateway.db.models import FineTuningStatus
from gateway.errors import GatewayError
from gateway.fine_tuning.request import Hyperparameters, Resolved, resolve
from gateway.fine_tuning.runner import fine_tuned_model
from gateway.fine_tuning.training_file import MAX_LISTED, check_training_file
from gateway.stores.fine_tuning_store import JobView

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
ANSWER = {"role": "assistant", "content": "yo"}


def _file(*lines: object) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def _refusal(content: bytes) -> str:
    with pytest.raises(GatewayError) as refused:
        check_training_file(content, "training_file")
    assert (refused.value.param, refused.value.code) == ("training_file", "invalid_training_file")
    return refused.value.message


def test_a_good_file_counts_its_examples_and_a_tools_field_is_allowed() -> None:
    with_tools = {"messages": GOOD["messages"], "tools": [], "parallel_tool_calls": False}
    assert check_training_file(_file(GOOD, with_tools), "training_file").examples == 2
    no_final_newline = _file(GOOD, GOOD).rstrip(b"\n")
    assert check_training_file(no_final_newline, "training_file").examples == 2
    # JSONL lines end at \n only: a raw U+2028 in a string is text (and the site agrees).
    separator = b'{"messages": [{"role": "assistant", "content": "a\xe2\x80\xa8b"}]}'
    assert check_training_file(_file(GOOD, separator), "training_file").examples == 2


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"{", "not JSON"),
        (b"[1]", "not a JSON object"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"prompt": "x", "completion": "y"}, "unknown field(s) completion, prompt"),
        ({"messages": [{"role": "user", "content": "q"}]}, "no assistant message"),
        ({"messages": [{"role": "bot", "content": "q"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content must be"),
        ({"messages": ["hi"]}, "messages[0] is not an object"),
        (b"", "an empty line"),
        # The site renders and learns system, user and assistant messages only (issue 58).
        ({"messages": [{"role": "tool", "content": "4"}, ANSWER]}, "messages[0].role must be"),
        # Issue 58: these were 500s.
        (b'{"messages": [{"role": "assistant", "content": "\xff"}]}', "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_each_kind_of_bad_line_is_named_by_its_number(line: object, reason: str) -> None:
    message = _refusal(_file(GOOD, line, GOOD))
    assert f"line 2: {reason}" in message
    assert "1 of the file's 3 lines" in message


def test_many_bad_lines_list_the_first_and_count_the_rest() -> None:
    message = _refusal(_file(*([b"{"] * (MAX_LISTED + 5))))
    assert f"line {MAX_LISTED}: not JSON" in message
    assert f"line {MAX_LISTED + 1}:" not in message
    assert "and 5 more" in message
    assert "holds no training example" in _refusal(b"")


def test_auto_hyperparameters_resolve_and_given_ones_stay() -> None:
    assert resolve(None, 10) == Resolved(3, 1, 1.0)
    assert resolve(Hyperparameters("auto", "auto", "auto"), 1000) == Resolved(3, 8, 1.0)
    assert resolve(Hyperparameters(5, 4, 2), 10) == Resolved(5, 4, 2.0)


def test_the_model_name_is_ft_base_suffix_id() -> None:
    now = datetime.now(UTC)
    job = JobView(
        "ftjob-abc123", 1, "k", "tiny", "file-1", None, "support", 0, 1, 1, 1.0,
        FineTuningStatus.SUCCEEDED, "s", 0, 0, 0, None, None, None, now, None, None,
    )  # fmt: skip
    assert fine_tuned_model(job) == "ft:tiny:support:abc123"
    assert fine_tuned_model(replace(job, suffix=None)) == "ft:tiny::abc123"
