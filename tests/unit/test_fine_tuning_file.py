"""The fine-tuning API's parts that need no database (issue 54): a chat training file checked
line by line, and against the model's context (issue 67), the hyperparameters' "auto", a key's
training limits, and the model name a succeeded job is served under (that model's privacy:
tests/unit/test_adapter_models.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest

from fedllm_contract.tokenizer import load_tokenizer
from fedllm_contract.training_data import MAX_LISTED
from fedllm_contract.training_tokens import ContextCheck, token_count
from gateway.db.models import FineTuningStatus
from gateway.errors import GatewayError
from gateway.fine_tuning.file_check import LengthLimit, check_training_file
from gateway.fine_tuning.limits import TrainingLimits, tokens_of
from gateway.fine_tuning.request import Hyperparameters, Resolved, resolve
from gateway.fine_tuning.runner import fine_tuned_model
from gateway.stores.fine_tuning_store import JobUse, JobView

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
ANSWER = {"role": "assistant", "content": "yo"}


def _file(*lines: object) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def _refusal(content: bytes, limit: LengthLimit | None = None) -> str:
    with pytest.raises(GatewayError) as refused:
        check_training_file(content, "training_file", limit)
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


def test_a_line_longer_than_the_context_is_named_with_its_tokens(gpt2_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(gpt2_tokenizer_dir)
    limit = LengthLimit(str(gpt2_tokenizer_dir), 256)
    long = {"messages": [{"role": "user", "content": "word " * 300}, ANSWER]}
    message = _refusal(_file(GOOD, long, GOOD), limit)
    tokens = token_count(tokenizer, long["messages"])
    assert tokens > 256
    assert f"line 2: {tokens} tokens as the model's chat template renders it" in message
    assert "longer than the model's context of 256 tokens" in message
    assert "1 of the file's 3 lines" in message
    fits = {"messages": [{"role": "user", "content": "word " * 150}, ANSWER]}
    assert check_training_file(_file(GOOD, fits), "training_file", limit).examples == 2
    # Within the context, past what the training sites' reserve holds of one example (issue
    # 75): named in tokens.
    held = LengthLimit(str(gpt2_tokenizer_dir), 256, reserve=100)
    message = _refusal(_file(GOOD, fits, GOOD), held)
    tokens = token_count(tokenizer, fits["messages"])
    assert 100 < tokens <= 256
    assert f"line 2: {tokens} tokens as the model's chat template renders it, more" in message
    assert "more than the 100 tokens an example may have in the fine-tuning memory reserve" in (
        message
    )
    assert "longer than the model's context of 256 tokens" in _refusal(_file(long), held)


@pytest.mark.parametrize(
    "content",
    ["word " * 50, "😀" * 40, "漢字かな交じり文" * 10, "a\u2028b\x00c" * 20, "  \n\t" * 30, ""],
)
def test_a_conversations_tokens_are_never_more_than_its_bound(
    gpt2_tokenizer_dir: Path, content: str
) -> None:
    """The bound that spares a short line its count (fedllm_contract/training_tokens.py): a
    byte-level tokenizer makes no more tokens than the rendered text has bytes."""
    check = ContextCheck(load_tokenizer(gpt2_tokenizer_dir), 10**6)
    for roles in (("user", "assistant"), ("system", "user", "assistant", "user", "assistant")):
        messages = [{"role": role, "content": content} for role in roles]
        assert token_count(check.tokenizer, messages) <= check.bound(messages)
        assert check(messages) is None


def test_a_line_the_chat_template_refuses_is_named(gpt2_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(gpt2_tokenizer_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    check = ContextCheck(tokenizer, 1024)
    assert check([{"role": "user", "content": "q"}, ANSWER]) is None
    refused = check([{"role": "system", "content": "s"}, ANSWER])
    assert refused is not None
    assert "chat template cannot render it (no system messages)" in refused


def test_a_refused_file_costs_a_reading_and_checks_under_way_are_bounded() -> None:
    limits = TrainingLimits(jobs_per_key=5, tokens_per_day=10_000, validations_per_key=1)
    refused = JobUse(True, 0, 3, 8_000, refused_files=True)
    assert tokens_of(refused) == 2_000  # one reading: its bytes / 4, not x its epochs
    assert tokens_of(JobUse(True, 0, 3, 8_000)) == 0  # a job cancelled before it trained
    limits.check("k", None, [refused], 8_000)
    with pytest.raises(GatewayError) as over:
        limits.check("k", None, [refused], 8_001)
    assert over.value.code == "training_tokens_limit_exceeded"
    checking = JobUse(False, 0, 1, 100, validating=True)
    with pytest.raises(GatewayError) as busy:
        limits.check("k", None, [checking], 10)
    assert busy.value.code == "fine_tuning_validations_limit_exceeded"
    assert "GATEWAY_FINE_TUNING_VALIDATIONS_PER_KEY" in busy.value.message
