"""Logprobs written from each token's own bytes (issue 67): an emoji split over several tokens
keeps its bytes, so the tokens' bytes joined are the text's; completions' `text_offset` stays
inside the text and points at each token's text; distinct partial tokens stay distinct
`top_logprobs` keys. With GPT-2's byte-level vocabulary and a SentencePiece-style one with byte
fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from fedllm_contract.tokenizer import load_tokenizer
from gateway.completions.logprobs import (
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
    completion_token,
)
from gateway.sites.interface import TokenLogprob
from gateway.token_bytes import TokenBytes

TEXT = "Hi 😀 and é, 歪 🎉!"


@pytest.fixture(scope="module")
def gpt2(gpt2_tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(gpt2_tokenizer_dir)


def values(ids: list[int], alternatives: int = 0) -> list[TokenLogprob]:
    """A logprob per token, with the next `alternatives` ids as its alternatives."""
    return [
        TokenLogprob(-0.5, tuple((i + k, None, -1.0 - k) for k in range(alternatives))) for i in ids
    ]


def test_chat_bytes_rebuild_the_text_where_tokens_split_a_character(gpt2) -> None:
    ids = gpt2.encode(TEXT)
    own = TokenBytes(gpt2)
    content = chat_logprobs(ids, values(ids), own)
    assert b"".join(bytes(token.bytes) for token in content) == TEXT.encode()
    partial = [token for token in content if token.token == "\ufffd"]
    assert len(partial) >= 2  # the emoji are split over tokens here
    assert all(token.bytes != [239, 191, 189] for token in partial)
    # Alone, each piece is still what the tokenizer decodes it as.
    assert [token.token for token in content] == [gpt2.decode([i]) for i in ids]


def test_completion_offsets_point_at_each_token_in_the_text(gpt2) -> None:
    ids = gpt2.encode(TEXT)
    echo = "Say: "
    logprobs = completion_logprobs(ids, values(ids), TokenBytes(gpt2), TextOffsets(len(echo)))
    text = echo + TEXT
    offsets = logprobs.text_offset
    assert offsets == sorted(offsets)
    assert offsets[0] == len(echo)
    assert max(offsets) < len(text)
    for token, offset in zip(logprobs.tokens, offsets, strict=True):
        if token.startswith("bytes:"):
            continue  # part of a character: it begins where its character does
        assert text[offset : offset + len(token)] == token
    assert any(token.startswith("bytes:") and "\\xf0\\x9f" in token for token in logprobs.tokens)


def test_streamed_offsets_are_the_whole_answers(gpt2) -> None:
    ids = gpt2.encode(TEXT)
    own = TokenBytes(gpt2)
    whole = completion_logprobs(ids, values(ids), own, TextOffsets())
    offsets = TextOffsets()
    streamed: list[int] = []
    for i in range(0, len(ids), 2):
        piece = ids[i : i + 2]
        streamed += completion_logprobs(piece, values(piece), own, offsets).text_offset
    assert streamed == whole.text_offset


def test_distinct_partial_tokens_stay_distinct_alternatives(gpt2) -> None:
    own = TokenBytes(gpt2)
    partial = [i for i in gpt2.encode("😀🎉🚀") if completion_token(own(i)).startswith("bytes:")]
    partial = list(dict.fromkeys(partial))[:3]
    assert len(partial) == 3
    assert {gpt2.decode([i]) for i in partial} == {"\ufffd"}  # alone, they all read alike
    value = TokenLogprob(-0.1, tuple((i, None, -0.1 - k) for k, i in enumerate(partial)))
    logprobs = completion_logprobs(partial[:1], [value], own, TextOffsets())
    assert logprobs.top_logprobs is not None
    assert len(logprobs.top_logprobs[0]) == 3
    assert logprobs.tokens[0] in logprobs.top_logprobs[0]


def test_special_tokens_are_no_bytes_and_alternatives_by_text_are_theirs(gpt2) -> None:
    own = TokenBytes(gpt2)
    assert own(gpt2.eos_token_id) == b""
    (token,) = chat_logprobs([0], [TokenLogprob(-0.2, ((None, "é", -0.2),))], own)
    assert token.top_logprobs[0].bytes == list("é".encode())


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style vocabulary: "\u2581" for spaces, unknown characters as <0xHH>."""
    pieces = ["\u2581", "H", "i", "\u2581H", "\u2581Hi"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {piece: 3 + i for i, piece in enumerate(pieces)}
    vocab |= {f"<0x{byte:02X}>": 3 + len(pieces) + byte for byte in range(256)}
    merges = [("\u2581", "H"), ("\u2581H", "i")]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def test_byte_fallback_tokens_are_their_byte() -> None:
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer.encode("Hi 😀", add_special_tokens=False)
    own = TokenBytes(tokenizer)
    assert own(ids[0]) == b" Hi"
    assert [own(i) for i in ids[-4:]] == [bytes([b]) for b in "😀".encode()]
    assert b"".join(own(i) for i in ids).decode() == tokenizer.decode(ids) == " Hi 😀"
