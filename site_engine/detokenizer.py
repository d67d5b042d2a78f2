"""Incremental detokenization and stop-string detection for one request.

Byte-level BPE tokens can split a UTF-8 character, so text is released only once it decodes
cleanly; decoding restarts from a short window of recent tokens rather than the whole output,
which keeps the cost per token constant (the prefix/read offset scheme of vLLM and TGI).

An answer that ends inside a character (max_tokens cut it) still releases what its tokens hold,
at its end: the text before the character, and U+FFFD for the character's bytes, as the tokens'
bytes joined read with errors="replace" (issue 75: the answer's text lost a space before a cut
emoji, while its logprobs' bytes said it, and the two no longer agreed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

# Enough context for the tokenizer to merge spaces and multi-byte characters correctly.
_WINDOW = 6


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: PreTrainedTokenizerBase
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stopped: bool = False
    _prefix_offset: int = 0
    _read_offset: int = 0
    _released: int = 0

    def push(self, new_token_ids: tuple[int, ...] | list[int]) -> str:
        """Adds tokens and returns the newly released text (cut at a stop string, if one hit)."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        prefix, full = self._decoded()
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix) :]
        self._prefix_offset = max(self._read_offset, len(self.token_ids) - _WINDOW)
        self._read_offset = len(self.token_ids)
        return self._apply_stop(delta)

    def flush(self) -> str:
        """The answer's end: releases the text held back, the tokens of a character cut short
        (U+FFFD for it) and a tail that might have begun a stop string."""
        if not self.stopped and self._read_offset < len(self.token_ids):
            prefix, full = self._decoded()
            self._read_offset = len(self.token_ids)
            if len(full) > len(prefix):
                released = self._apply_stop(full[len(prefix) :])
                return released + self._rest()
        return self._rest()

    def _decoded(self) -> tuple[str, str]:
        """The window's text before the tokens not yet released, and with them."""
        window = self.token_ids[self._prefix_offset :]
        prefix = self.tokenizer.decode(
            window[: self._read_offset - self._prefix_offset], skip_special_tokens=True
        )
        return prefix, self.tokenizer.decode(window, skip_special_tokens=True)

    def _rest(self) -> str:
        """Text held back because it might have begun a stop string."""
        rest = self.text[self._released :]
        self._released = len(self.text)
        return rest

    def _apply_stop(self, delta: str) -> str:
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
