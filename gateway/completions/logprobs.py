"""Log probabilities in OpenAI's two shapes: chat's `logprobs.content` (token, logprob, bytes,
top_logprobs) and completions' `logprobs` (tokens, token_logprobs, top_logprobs, text_offset).

Every token is written from its own bytes (gateway/token_bytes.py), never from its text decoded
alone: a token holding part of a multi-byte character (a piece of an emoji) has no text of its
own. So, as OpenAI writes them:
- chat: `bytes` are the token's own, and the bytes of an answer's tokens joined are its text's
  UTF-8; `token` is those bytes decoded (U+FFFD for a partial character);
- completions: a token that is not whole UTF-8 is written `bytes:\\xf0\\x9f` (OpenAI's
  spelling), so that distinct tokens stay distinct keys of `top_logprobs`; `text_offset` is
  where the token's text begins in the choice's text, in characters: a token that continues a
  character begun by the one before it begins where that character does.

The sites report token ids (our engine) or token texts (an OpenAI-compatible engine's
alternatives, which are then their text's bytes).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

import msgspec

from gateway.sites.interface import TokenLogprob

# A token id -> its own bytes, as the model's tokenizer maps it.
TokenBytes = Callable[[int], bytes]


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


def _own_bytes(token_id: int | None, text: str | None, token_bytes: TokenBytes) -> bytes:
    if token_id is not None:
        return token_bytes(token_id)
    return (text or "").encode()


def chat_logprobs(
    token_ids: Sequence[int], values: Sequence[TokenLogprob], token_bytes: TokenBytes
) -> list[ChatTokenLogprob]:
    out = []
    for token_id, value in zip(token_ids, values, strict=False):
        own = token_bytes(token_id)
        top = []
        for i, text, logprob in value.top:
            alternative = _own_bytes(i, text, token_bytes)
            top.append(TopLogprob(alternative.decode(errors="replace"), logprob, list(alternative)))
        out.append(ChatTokenLogprob(own.decode(errors="replace"), value.logprob, list(own), top))
    return out


def completion_token(own: bytes) -> str:
    """A token as completions' `tokens` and `top_logprobs` keys write it: its text, or
    `bytes:\\xNN...` when its bytes are not whole UTF-8."""
    try:
        return own.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in own)


class TextOffsets:
    """Where each token of one choice begins in its text, in characters, fed the tokens' bytes
    in order (across a stream's chunks). `start`: the characters before the answer (an echoed
    prompt)."""

    def __init__(self, start: int = 0) -> None:
        self._chars = start
        # Holds a character's first bytes until its last arrives, as the text is released.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, own: bytes) -> int:
        """The offset of the token with bytes `own`, which then counts as read."""
        offset = self._chars
        self._chars += len(self._decoder.decode(own))
        return offset


def completion_logprobs(
    token_ids: Sequence[int],
    values: Sequence[TokenLogprob],
    token_bytes: TokenBytes,
    offsets: TextOffsets,
    with_top: bool = True,
) -> CompletionLogprobs:
    tokens: list[str] = []
    text_offset: list[int] = []
    for token_id in token_ids[: len(values)]:
        own = token_bytes(token_id)
        tokens.append(completion_token(own))
        text_offset.append(offsets.next(own))
    tops = []
    for value in values:
        top: dict[str, float] = {}
        for i, text, logprob in value.top:
            key = completion_token(_own_bytes(i, text, token_bytes))
            # Two that write alike (two special tokens: no bytes) keep the likelier.
            top[key] = max(logprob, top.get(key, logprob))
        tops.append(top)
    return CompletionLogprobs(
        tokens, [value.logprob for value in values], tops if with_top else None, text_offset
    )
