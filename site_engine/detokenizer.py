"""Incremental detokenization and stop-string detection for one request.

Byte-level BPE tokens can split a UTF-8 character, so text is released only once it decodes
cleanly. A fast tokenizer decodes through its own incremental stream (`tokenizers`'
DecodeStream, vLLM v1's fast detokenizer): a token costs ~1 us in Rust, and the tokens of
several steps go in one call (issue 74: a stream's tokens are detokenized when its reader takes
them, not one call per token). Any other tokenizer decodes a short window of recent tokens
again each time (the prefix/read offset scheme of vLLM and TGI), which keeps the cost per token
constant, about ten times the fast path's.

Stop strings are matched on the released text; `push_until_stop` takes tokens one at a time
while a request has stop strings, so the token that completes one is known (usage counts the
tokens up to it, as it did when each token came alone).

An answer that ends inside a character (max_tokens cut it) still releases what its tokens hold,
at its end (`flush`): the text before the character, and U+FFFD for the character's bytes, as
the tokens' bytes joined read with errors="replace" (issue 75: the answer's text lost a space
before a cut emoji, while its logprobs' bytes said it, and the two no longer agreed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# Enough context for the tokenizer to merge spaces and multi-byte characters correctly.
_WINDOW = 6


@dataclass(slots=True)
class _FastDecode:
    """The tokenizer's own incremental decoder; `pending` are the ids it holds back (an
    incomplete character), kept so the end of an answer can release them."""

    backend: Any
    stream: DecodeStream = field(default_factory=lambda: DecodeStream(skip_special_tokens=True))
    pending: list[int] = field(default_factory=list)

    def take_pending(self) -> list[int]:
        pending, self.pending = self.pending, []
        return pending

    def step(self, ids: Sequence[int]) -> str:
        text = self.stream.step(self.backend, list(ids))
        if text is None:
            self.pending.extend(ids)
            return ""
        self.pending.clear()
        return str(text)


@dataclass(slots=True)
class _WindowDecode:
    """Decodes a window of recent tokens again each time (a tokenizer without a fast backend)."""

    tokenizer: PreTrainedTokenizerBase
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def take_pending(self) -> list[int]:
        pending = self.ids[self.read_offset :]
        self.prefix_offset = self.read_offset = len(self.ids)
        return pending

    def step(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character: wait for the next token
        self.prefix_offset = max(self.read_offset, len(self.ids) - _WINDOW)
        self.read_offset = len(self.ids)
        return str(full[len(prefix) :])


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: PreTrainedTokenizerBase
    stop: tuple[str, ...] = ()
    text: str = ""
    stopped: bool = False
    _released: int = 0
    _decode: _FastDecode | _WindowDecode = field(init=False)

    def __post_init__(self) -> None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._decode = (
            _FastDecode(backend) if backend is not None else _WindowDecode(self.tokenizer)
        )

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Adds tokens and returns the newly released text (cut at a stop string, if one hit)."""
        if self.stopped or not new_token_ids:
            return ""
        return self._apply_stop(self._decode.step(new_token_ids))

    def push_until_stop(self, new_token_ids: Sequence[int]) -> tuple[str, int]:
        """push(), and how many of the tokens were taken: all of them, unless a stop string hit
        (then those up to the one that completed it; the rest are no part of the answer)."""
        if not self.stop:
            return self.push(new_token_ids), len(new_token_ids)
        released: list[str] = []
        for taken, token in enumerate(new_token_ids, 1):
            if self.stopped:
                return "".join(released), taken - 1
            released.append(self.push((token,)))
            if self.stopped:
                return "".join(released), taken
        return "".join(released), len(new_token_ids)

    def flush(self) -> str:
        """The answer's end: the tokens of a character it ended inside (decoded as the tokenizer
        decodes them, U+FFFD for the missing bytes: no generated text is lost), then a tail held
        back because it might have begun a stop string."""
        pending = self._decode.take_pending()
        if pending and not self.stopped:
            cut = self._apply_stop(self.tokenizer.decode(pending, skip_special_tokens=True))
            return cut + self._rest()
        return self._rest()

    def _rest(self) -> str:
        """Text held back because it might have begun a stop string."""
        rest = self.text[self._released :]
        self._released = len(self.text)
        return rest

    def _apply_stop(self, delta: str) -> str:
        if not delta:
            return ""
        if not self.stop:
            self.text += delta
            self._released = len(self.text)
            return delta
        combined = self.text + delta
        # A stop string may straddle earlier text and this delta.
        search_from = max(0, len(self.text) - self._longest_stop + 1)
        hits = [i for i in (combined.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = combined[: min(hits)], True
            return self._rest()
        self.text = combined
        # Hold back a tail that could still grow into a stop string, so it is never sent early.
        safe_end = len(combined) - self._held_back(combined)
        released = combined[self._released : safe_end]
        self._released = max(self._released, safe_end)
        return released

    @property
    def _longest_stop(self) -> int:
        return max(len(s) for s in self.stop)

    def _held_back(self, text: str) -> int:
        for length in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0
