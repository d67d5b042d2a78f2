"""Continuing an answer on another site after its site failed mid-stream.

The next site gets the prompt plus the answer tokens produced so far and generates the rest. Two
things about text need care at the seam, because the failed site's detokenizer held some text
back: text that might begin a stop string, and the bytes of a character split across tokens.

- `resume_point` decides which produced tokens the continuation keeps (trailing tokens that end
  in an incomplete character are dropped and generated again) and what text of the kept tokens
  the client has not been sent yet (the carry).
- `Splice` joins the carry with the next site's text. That site searches stop strings in its
  own text only, so a stop string that begins in the carry and ends in the new text is found
  here, and text that might still become one is held back, as the site does.

This relies on the site decoding an answer token by token the same way whether the tokens came
as prompt or as answer: true of byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2). A
SentencePiece tokenizer drops the leading space of the first answer token, so a continuation
on such a model can lose one space at the seam (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A UTF-8 character spans at most 4 bytes, so at most 3 trailing tokens can hold a partial one.
_MAX_PARTIAL_TOKENS = 3
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class ResumePoint:
    kept_token_ids: tuple[int, ...]
    # Text of the kept tokens that the client has not been sent (held back by the failed site).
    carry: str


def resume_point(
    token_ids: Sequence[int], sent_text: str, decode: Callable[[Sequence[int]], str]
) -> ResumePoint:
    """Contract: keeps the longest prefix of `token_ids` (dropping at most 3 trailing tokens)
    whose decoded text does not end in an incomplete character; the carry is that text less
    `sent_text`. When the decoded text does not begin with `sent_text` (a tokenizer that does
    not decode piecewise), the carry is empty: nothing is sent twice."""
    kept = list(token_ids)
    text = decode(kept)
    for _ in range(_MAX_PARTIAL_TOKENS):
        if not kept or not text.endswith(_REPLACEMENT):
            break
        kept.pop()
        text = decode(kept)
    carry = text[len(sent_text) :] if text.startswith(sent_text) else ""
    return ResumePoint(tuple(kept), carry)


@dataclass(slots=True)
class Splice:
    """Joins the carry with the continuing site's text, finding stop strings across the seam.

    Contract: the concatenation of everything `feed` and `flush` return equals
    (carry + all fed text) cut before the first occurrence of any stop string; no returned text
    ends with a proper prefix of a stop string unless it is the last (flush or stopped)."""

    stop: tuple[str, ...]
    pending: str = ""
    stopped: bool = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        combined = self.pending + text
        hits = [i for i in (combined.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return combined[: min(hits)]
        held = self._held_back(combined)
        self.pending = combined[len(combined) - held :] if held else ""
        return combined[: len(combined) - held]

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest

    def _held_back(self, text: str) -> int:
        longest = max((len(s) for s in self.stop), default=0)
        for length in range(min(len(text), longest - 1), 0, -1):
            if any(s.startswith(text[-length:]) for s in self.stop):
                return length
        return 0
