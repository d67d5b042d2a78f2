"""Prompts of seeded tokens that survive being sent as text.

A benchmark prompt made of random token ids cannot be sent as text: decoding and encoding again
gives other tokens. Routers that read text (SGLang's matches characters) need text, and every arm
must see the same prompts, so prompts are built from "word tokens": ids whose text is a space and
a lowercase word and that encode back to themselves alone. A byte-level BPE pre-tokenizer cuts
text at each space-word, so a sequence of such tokens decodes to text that encodes back to
exactly the same ids (checked for every prompt built: `encode`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Encode = Callable[[str], Sequence[int]]
Decode = Callable[[Sequence[int]], str]
_WORD = re.compile(r" [a-z]{3,12}")


@dataclass(frozen=True, slots=True)
class WordTokens:
    ids: tuple[int, ...]
    texts: dict[int, str]
    encode_text: Encode
    decode_ids: Decode

    @classmethod
    def of(cls, encode: Encode, decode: Decode, vocab: int, minimum: int = 1000) -> WordTokens:
        texts: dict[int, str] = {}
        for token in range(vocab):
            text = decode([token])
            if _WORD.fullmatch(text) and list(encode(text)) == [token]:
                texts[token] = text
        if len(texts) < minimum:
            raise ValueError(f"the tokenizer has only {len(texts)} word tokens (< {minimum})")
        return cls(tuple(sorted(texts)), texts, encode, decode)

    def draw(self, rng: random.Random, length: int) -> tuple[int, ...]:
        return tuple(rng.choices(self.ids, k=length))

    def text(self, ids: Sequence[int], check: bool = True) -> str:
        """The text of word-token ids; ValueError if it does not encode back to them (`check`:
        every word token does alone, so a long prompt may skip re-encoding it whole)."""
        text = "".join([self.texts[t] for t in ids])
        if check and tuple(self.encode_text(text)) != tuple(ids):
            raise ValueError("word tokens did not survive a round trip through text")
        return text
