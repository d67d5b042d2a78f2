"""The serving models' tokenizers at the gateway: it counts prompt tokens before routing.

Prompts are encoded by two copies of each model's Rust tokenizer, one that reads a special
token's text as that token (the chat template's control pieces) and one that reads it as plain
text (what a client wrote): transformers switches one shared tokenizer between the two per call
(`split_special_tokens`), which two threads of the tokenize pool could interleave, letting a
client's text become control tokens, and its Python wrapper cost as much as the encoding (50 us
against 23 us for a three-piece chat prompt with the gpt2 tokenizer).

A long piece goes through encode_batch, which releases the GIL while it works (encode holds it:
a megabyte of prompt on a tokenize-pool thread then held the event loop, /healthz included,
for a second); a short one through encode, whose hand-off costs less than the batch call's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase

from fedllm_contract.tokenizer import load_tokenizer, tokenizer_fingerprint
from gateway.federation import ModelConfig
from gateway.token_bytes import TokenBytes

# About a millisecond of encoding (a second per MiB): longer pieces release the GIL meanwhile.
GIL_FREE_CHARS = 1024


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    if len(text) > GIL_FREE_CHARS:
        (encoding,) = tokenizer.encode_batch([text], add_special_tokens=False)
    else:
        encoding = tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = encoding.ids
    return ids


@dataclass(frozen=True, slots=True)
class _Encoders:
    control: Tokenizer  # a special token's text is that token
    literal: Tokenizer  # it is text (encode_special_tokens)

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> _Encoders:
        source = tokenizer.backend_tokenizer.to_str()
        control, literal = Tokenizer.from_str(source), Tokenizer.from_str(source)
        for copy in (control, literal):
            copy.no_truncation()
            copy.no_padding()
        literal.encode_special_tokens = True
        return cls(control, literal)


class ModelTokenizers:
    def __init__(self, models: tuple[ModelConfig, ...]) -> None:
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {
            model.name: load_tokenizer(model.tokenizer) for model in models
        }
        self._encoders = {name: _Encoders.of(tok) for name, tok in self._tokenizers.items()}
        self.fingerprints = {
            name: tokenizer_fingerprint(tok) for name, tok in self._tokenizers.items()
        }
        self._specials = {name: _special_texts(tok) for name, tok in self._tokenizers.items()}
        self._token_bytes = {name: TokenBytes(tok) for name, tok in self._tokenizers.items()}

    def __contains__(self, model: str) -> bool:
        return model in self._tokenizers

    def models(self) -> list[str]:
        return sorted(self._tokenizers)

    def encode(self, model: str, text: str) -> list[int]:
        """`text` with its special tokens' text read as those tokens (a raw completions prompt
        or a site's answer text)."""
        return _ids(self._encoders[model].control, text)

    def encode_inputs(self, model: str, texts: list[str]) -> list[list[int]]:
        """Texts to embed, each as the model's tokenizer encodes it by default: its special
        tokens added around it (BERT's [CLS] ... [SEP]), as the embedding model was trained and
        as sentence-transformers feeds it. Several at once in one batch call, which releases
        the GIL and runs them in parallel."""
        encoder = self._encoders[model].control
        if len(texts) == 1 and len(texts[0]) <= GIL_FREE_CHARS:
            return [encoder.encode(texts[0], add_special_tokens=True).ids]
        return [encoding.ids for encoding in encoder.encode_batch(texts, add_special_tokens=True)]

    def encode_pieces(self, model: str, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """Pieces of one prompt, each tokenized on its own: `literal` ones as plain text, the
        text of any special token in them included (gateway/chat/templates.py's
        RenderedChat)."""
        encoders = self._encoders[model]
        ids: list[int] = []
        for text, literal in pieces:
            encoder = encoders.literal if literal else encoders.control
            ids += _ids(encoder, text)
        return ids

    def special_tokens(self, model: str) -> tuple[str, ...]:
        """The text of the model's special tokens (control tokens: turn markers, EOS, ...)."""
        return self._specials[model]

    def decode(self, model: str, token_ids: list[int]) -> str:
        text: str = self._tokenizers[model].decode(token_ids)
        return text

    def decode_answer(self, model: str, token_ids: list[int]) -> str:
        """An answer's text as the sites' detokenizer writes it (special tokens left out)."""
        text: str = self._tokenizers[model].decode(token_ids, skip_special_tokens=True)
        return text

    def token_bytes(self, model: str, token_id: int) -> bytes:
        """The token's own bytes (gateway/token_bytes.py): what logprobs' `bytes` carry."""
        return self._token_bytes[model](token_id)

    def vocab_size(self, model: str) -> int:
        return len(self._tokenizers[model])


def _special_texts(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    added = (token.content for token in tokenizer.added_tokens_decoder.values() if token.special)
    return tuple(sorted({*tokenizer.all_special_tokens, *added}))
