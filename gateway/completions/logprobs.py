"""Log probabilities in OpenAI's two shapes: chat's `logprobs.content` (token, logprob, bytes,
top_logprobs) and completions' `logprobs` (tokens, token_logprobs, top_logprobs, text_offset).

The sites report token ids (our engine) or token texts (an OpenAI-compatible engine's
alternatives); the gateway writes each token as the model's tokenizer decodes it alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from gateway.sites.interface import TokenLogprob

Decode = Callable[[int], str]


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


def _text(token_id: int | None, text: str | None, decode: Decode) -> str:
    if text is not None:
        return text
    return decode(token_id) if token_id is not None else ""


def chat_logprobs(
    token_ids: Sequence[int], values: Sequence[TokenLogprob], decode: Decode
) -> list[ChatTokenLogprob]:
    out = []
    for token_id, value in zip(token_ids, values, strict=False):
        token = decode(token_id)
        top = [
            TopLogprob(t := _text(i, text, decode), lp, list(t.encode()))
            for i, text, lp in value.top
        ]
        out.append(ChatTokenLogprob(token, value.logprob, list(token.encode()), top))
    return out


def completion_logprobs(
    token_ids: Sequence[int],
    values: Sequence[TokenLogprob],
    decode: Decode,
    start_offset: int = 0,
    with_top: bool = True,
) -> CompletionLogprobs:
    tokens: list[str] = []
    offsets: list[int] = []
    offset = start_offset
    for token_id in token_ids[: len(values)]:
        token = decode(token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    tops = [{_text(i, text, decode): lp for i, text, lp in value.top} for value in values]
    return CompletionLogprobs(
        tokens, [value.logprob for value in values], tops if with_top else None, offsets
    )
