"""Incremental detokenization and stop-string detection for one request.

Byte-level BPE tokens can split a UTF-8 character, so text is released only once it decodes
cleanly; decoding restarts from a short window of recent tokens rather than the whole output,
which keeps the cost per token constant (the prefix/read offset scheme of vLLM and TGI).
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
        prefix = self.tokenizer.decode(
            self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = self.tokenizer.decode(
            self.token_ids[self._prefix_offset :], skip_special_tokens=True
        )
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character: wait for the next token
        delta = full[len(prefix) :]
        self._prefix_offset = max(self._read_offset, len(self.token_ids) - _WINDOW)
        self._read_offset = len(self.token_ids)
        return self._apply_stop(delta)

    def flush(self) -> str:
        """Releases text held back because it might have begun a stop string (call at the end)."""
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
            return self.flush()
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
