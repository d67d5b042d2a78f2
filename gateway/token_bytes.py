"""Each token's own bytes, as its tokenizer maps it: what logprobs' `bytes` carry.

A token of a byte-level BPE vocabulary (GPT-2, Llama 3, Qwen2, SmolLM2) is a run of raw bytes,
which need not be whole UTF-8 characters: an emoji is often two or three tokens. Decoded alone,
each such piece is U+FFFD, whose bytes [239, 191, 189] rebuild nothing. The vocabulary stores
each byte as one printable character (GPT-2's byte-to-unicode table); the table is transformers'
own (`bytes_to_unicode`), so a token's bytes are its vocabulary string read back through it, as
the tokenizer's ByteLevel decoder reads it.

A vocabulary with byte fallback (SentencePiece models: Llama 2, Mistral) spells a raw byte as a
token `<0xHH>`: that token is the byte. Its other tokens are their vocabulary string with the
decoder's own replacements (`Replace` of "\u2581" by a space, `Metaspace`), in UTF-8; added
tokens are their text's UTF-8. Special tokens are no bytes: the answer's text leaves them out
(`skip_special_tokens`, as the sites' detokenizer does), so the bytes of an answer's tokens
joined are its text's.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _decoders(tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    """The tokenizer's decoders as its tokenizer.json describes them, a Sequence's members in
    order."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    members = decoder.get("decoders") or [decoder]
    return [member for member in members if isinstance(member, dict)]


def _replacements(decoders: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """What the decoders replace in a token's string: a Replace of a plain string, Metaspace's
    replacement character by a space."""
    out = []
    for decoder in decoders:
        pattern = decoder.get("pattern")
        if decoder.get("type") == "Replace" and isinstance(pattern, dict):
            if isinstance(pattern.get("String"), str):
                out.append((pattern["String"], str(decoder.get("content", ""))))
        elif decoder.get("type") == "Metaspace":
            out.append((str(decoder.get("replacement", "\u2581")), " "))
    return out


class TokenBytes:
    """Token id -> the token's own bytes, for one tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        decoders = _decoders(tokenizer)
        kinds = {decoder.get("type") for decoder in decoders}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._replacements = _replacements(decoders)
        added = tokenizer.added_tokens_decoder
        self._special = frozenset(i for i, token in added.items() if token.special)
        self._added: dict[int, bytes] = {
            i: token.content.encode() for i, token in added.items() if not token.special
        }
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return b""
        if token_id in self._added:
            return self._added[token_id]
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # an id outside the vocabulary
            return b""
        if self._byte_level:
            table = _unicode_to_byte()
            if all(char in table for char in piece):
                return bytes(table[char] for char in piece)
        if self._byte_fallback and (match := _BYTE_TOKEN.match(piece)):
            return bytes([int(match.group(1), 16)])
        if self._replacements:
            for pattern, content in self._replacements:
                piece = piece.replace(pattern, content)
            return str(piece).encode()
        # Neither byte-level nor SentencePiece: the token as its tokenizer decodes it alone.
        text: str = self._tokenizer.decode([token_id], skip_special_tokens=True)
        return text.encode()
