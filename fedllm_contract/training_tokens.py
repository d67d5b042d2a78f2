"""A training conversation as a site trains on it: the text the model's chat template renders
(the tokenizer's own template, ChatML when it has none) and how many tokens that is. The site
learns from this text (site_engine/finetune/data.py); the gateway refuses a line longer than the
model's context with it, naming the line (issue 67: such a line passed the gateway and then
failed the job at the site).

Counting every line's tokens would cost the gateway a second of CPU per MiB of file, for lines
that are nearly always far shorter than the context. A byte-level tokenizer never makes more
tokens than the text has bytes (every token, a special one too, stands for at least one byte of
it), so a line whose rendered text has at most `context` bytes needs no count: its bound is the
template's own text for that sequence of roles (rendered once per sequence, with one-character
contents) plus the contents' bytes. Only a line past that bound is rendered and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from fedllm_contract.tokenizer import CHATML_TEMPLATE

Message = dict[str, str]
# Tokens a tokenizer may add that stand for no byte of the text (a SentencePiece tokenizer's
# leading "▁", say), a few per message at most.
_SLACK, _SLACK_PER_MESSAGE = 8, 2
_PROBE = "x"  # the content of every message of a template's probe


def render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], prompt: bool) -> str:
    """The conversation as the model's chat template writes it (`prompt`: with the assistant's
    header after it, as a served request ends)."""
    template = None if tokenizer.chat_template else CHATML_TEMPLATE
    text = tokenizer.apply_chat_template(
        list(messages), chat_template=template, tokenize=False, add_generation_prompt=prompt
    )
    assert isinstance(text, str)
    return text


def token_count(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> int:
    """The conversation's tokens as a site trains on them."""
    ids = tokenizer(render(tokenizer, messages, prompt=False), add_special_tokens=False)
    return len(ids["input_ids"])


@dataclass(slots=True)
class ContextCheck:
    """A line check (fedllm_contract/training_data.py's LineCheck): a problem for a
    conversation of more than `context` tokens, or of more than `reserve` (the tokens an
    example may have in the training sites' memory reserve, when they say), or one the chat
    template refuses to render."""

    tokenizer: PreTrainedTokenizerBase
    context: int
    reserve: int | None = None
    # The template's own bytes for a sequence of roles (its probe's, less the probe contents).
    _skeletons: dict[tuple[str, ...], int] = field(default_factory=dict)

    def bound(self, messages: list[Message]) -> int:
        """The most tokens the conversation can be: its rendered text's bytes, and slack."""
        content = sum(len(m["content"].encode()) for m in messages)
        return self._skeleton(messages) + content + _SLACK + _SLACK_PER_MESSAGE * len(messages)

    def __call__(self, messages: list[Message]) -> str | None:
        most = min(self.context, self.reserve or self.context)
        try:
            if self.bound(messages) <= most:
                return None
            tokens = token_count(self.tokenizer, messages)
        except (TemplateError, ValueError) as exc:
            return f"the model's chat template cannot render it ({str(exc)[:200]})"
        rendered = f"{tokens} tokens as the model's chat template renders it"
        if tokens > self.context:
            return f"{rendered}, longer than the model's context of {self.context} tokens"
        if tokens > most:
            return (
                f"{rendered}, more than the {most} tokens an example may have in the "
                "fine-tuning memory reserve of the sites that train the model"
            )
        return None

    def _skeleton(self, messages: list[Message]) -> int:
        roles = tuple(m["role"] for m in messages)
        found = self._skeletons.get(roles)
        if found is None:
            probe = [{"role": role, "content": _PROBE} for role in roles]
            text = render(self.tokenizer, probe, prompt=False)
            found = max(0, len(text.encode()) - len(_PROBE) * len(roles))
            self._skeletons[roles] = found
        return found
