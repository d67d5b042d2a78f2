"""The serving models' tokenizers at the gateway: it counts prompt tokens before routing."""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from fedllm_contract.tokenizer import load_tokenizer, tokenizer_fingerprint
from gateway.federation import ModelConfig


class ModelTokenizers:
    def __init__(self, models: tuple[ModelConfig, ...]) -> None:
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {
            model.name: load_tokenizer(model.tokenizer) for model in models
        }
        self.fingerprints = {
            name: tokenizer_fingerprint(tok) for name, tok in self._tokenizers.items()
        }
        self._specials = {name: _special_texts(tok) for name, tok in self._tokenizers.items()}

    def __contains__(self, model: str) -> bool:
        return model in self._tokenizers

    def models(self) -> list[str]:
        return sorted(self._tokenizers)

    def encode(self, model: str, text: str) -> list[int]:
        ids: list[int] = self._tokenizers[model].encode(text, add_special_tokens=False)
        return ids

    def encode_pieces(self, model: str, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """Pieces of one prompt, each tokenized on its own: `literal` ones as plain text, the
        text of any special token in them included (gateway/chat/templates.py's
        RenderedChat)."""
        tokenizer = self._tokenizers[model]
        ids: list[int] = []
        for text, literal in pieces:
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=literal)
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

    def vocab_size(self, model: str) -> int:
        return len(self._tokenizers[model])


def _special_texts(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    added = (token.content for token in tokenizer.added_tokens_decoder.values() if token.special)
    return tuple(sorted({*tokenizer.all_special_tokens, *added}))
