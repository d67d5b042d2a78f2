"""A fine-tuning job's chat JSONL turned into token ids, with loss on the assistant's tokens only.

The gateway validated the file line by line (OpenAI's chat format: one {"messages": [...]}
object a line) with the check this runs again (fedllm_contract/training_data.py, both sides'
one), and this renders every conversation with the chat template the site serves (the
tokenizer's own, ChatML when it has none), so that the model learns the exact token layout it
will later see at inference. A token counts toward the loss when it starts inside an
assistant message's rendered text: its content and the end-of-turn marker after it (the model
learns to stop), never the template's `<|im_start|>assistant\\n` header, which the serving side
writes itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from fedllm_contract import training_data
from fedllm_contract.training_data import Stopped, TrainingFileError
from fedllm_contract.training_tokens import render

IGNORE = -100  # the label of a token the loss skips (torch's cross_entropy ignore_index)


class TrainingDataError(ValueError):
    """The file cannot be trained on; the message names the line."""


@dataclass(frozen=True, slots=True)
class Example:
    """One conversation: its token ids and labels (IGNORE where no loss is taken)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def trained_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE)


def parse_chat_jsonl(
    data: bytes, stop: Callable[[], bool] | None = None
) -> list[list[dict[str, str]]]:
    """The conversations of a chat JSONL file, checked as the gateway checked it (the one
    check both import: fedllm_contract/training_data.py); TrainingDataError naming the bad
    lines; Stopped when `stop` says so."""
    try:
        return training_data.conversations(data, stop)
    except TrainingFileError as exc:
        raise TrainingDataError(str(exc)) from exc


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (from after
    the generation prompt to the end of the turn as the template writes it)."""
    text = render(tokenizer, messages, prompt=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(tokenizer, messages[:i], prompt=True)) if i else 0
        through = render(tokenizer, messages[: i + 1], prompt=False)
        # Up to the end-of-turn marker: the newline a template writes after it is no token the
        # model generates when served (it stops at the marker).
        end = len(through.rstrip())
        if not text.startswith(through):
            raise TrainingDataError(
                "the chat template does not render a conversation's turns as prefixes of it: "
                "cannot tell the assistant's tokens apart"
            )
        spans.append((start, end))
    return text, spans


def encode(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], max_tokens: int
) -> Example:
    """One conversation's ids and labels, cut to `max_tokens` (its end is lost, not its start)."""
    text, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])[:max_tokens]
    offsets = encoded["offset_mapping"][: len(ids)]
    labels = [
        token if any(lo <= start < hi for lo, hi in spans) else IGNORE
        for token, (start, _) in zip(ids, offsets, strict=True)
    ]
    return Example(tuple(ids), tuple(labels))


def encode_file(
    tokenizer: PreTrainedTokenizerBase,
    data: bytes,
    max_tokens: int,
    stop: Callable[[], bool] | None = None,
) -> list[Example]:
    """Every conversation of the file; TrainingDataError if one keeps no assistant token;
    Stopped (fedllm_contract/training_data.py) as soon as `stop` says so: a job cancelled
    while its file is read stops the reading (issue 67)."""
    examples = []
    for number, messages in enumerate(parse_chat_jsonl(data, stop), start=1):
        if stop is not None and number % training_data.STOP_EVERY == 0 and stop():
            raise Stopped(f"stopped at example {number}")
        example = encode(tokenizer, messages, max_tokens)
        if not example.loss_tokens:
            raise TrainingDataError(
                f"example {number}: no assistant token within {max_tokens} tokens"
            )
        examples.append(example)
    return examples
