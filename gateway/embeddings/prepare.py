"""Preparing an embeddings request: the model checked to be an embedding model (a clear 404
naming the embedding models otherwise), `input` in its four forms turned into token-id lists
(texts tokenized with the model's tokenizer, its special tokens added as the model expects),
each checked against the model's input length and vocabulary, and the options checked. Nothing
changes before it passes: a 400 or 404 here costs the caller nothing."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.embeddings.request import EmbeddingInput, EmbeddingRequest
from gateway.errors import GatewayError, NotFound, context_exceeded, invalid_request
from gateway.sites.interface import EmbedParams
from gateway.sites.registry import SiteRegistry
from gateway.tokenizers import ModelTokenizers

# OpenAI's bound on the inputs of one request.
MAX_INPUTS = 2048
EncodingFormat = Literal["float", "base64"]
_FORMATS: tuple[EncodingFormat, ...] = ("float", "base64")


@dataclass(frozen=True, slots=True)
class PreparedEmbedding:
    request_id: str
    created: int
    model: str
    params: EmbedParams
    encoding_format: EncodingFormat
    user: str | None

    @property
    def prompt_tokens(self) -> int:
        return self.params.prompt_tokens


def not_an_embedding_model(model: str, embedding_models: Sequence[str]) -> GatewayError:
    """The 404 of /v1/embeddings for a model that is not an embedding model here."""
    if embedding_models:
        known = f"embedding models here: {', '.join(embedding_models)}"
    else:
        known = (
            "no embedding model is configured on this gateway (an embedding model is a model "
            'with "task": "embed" in the federation file)'
        )
    return NotFound(
        f"/v1/embeddings is served here, but no site serves an embedding model named "
        f"'{model}'; {known}",
        param="model",
        code="model_not_found",
    )


class EmbeddingPreparer:
    def __init__(
        self,
        registry: SiteRegistry,
        tokenizers: ModelTokenizers,
        embedding_models: Sequence[str],
        max_chars_per_token: int,
    ) -> None:
        """`max_chars_per_token`: GATEWAY_MAX_PROMPT_CHARS_PER_TOKEN, the most characters any
        tokenizer reads into one token (a longer text cannot fit, whatever its tokens)."""
        self._registry = registry
        self._tokenizers = tokenizers
        self.models = tuple(sorted(embedding_models))
        self._chars_per_token = max_chars_per_token

    def prepare(self, req: EmbeddingRequest) -> PreparedEmbedding:
        if req.model not in self.models:
            raise not_an_embedding_model(req.model, self.models)
        if req.encoding_format not in _FORMATS:
            raise invalid_request(
                f"encoding_format must be one of {list(_FORMATS)}, got {req.encoding_format!r}",
                param="encoding_format",
            )
        encoding: EncodingFormat = "base64" if req.encoding_format == "base64" else "float"
        inputs = self._inputs(req.model, req.input)
        params = EmbedParams(
            request_id=f"embd-{uuid.uuid4().hex}",
            inputs=inputs,
            dimensions=self._dimensions(req.model, req.dimensions),
        )
        return PreparedEmbedding(
            params.request_id, int(time.time()), req.model, params, encoding, req.user
        )

    def _dimensions(self, model: str, dimensions: int | None) -> int | None:
        """None for the model's own length; 400 for one its sites cannot give (where they say
        their length: this project's sites; an engine behind an `openai` site decides itself)."""
        if dimensions is None:
            return None
        if dimensions < 1:
            raise invalid_request("dimensions must be at least 1", param="dimensions")
        own = self._registry.embedding_dimension(model)
        if own is None:
            return dimensions
        if dimensions != own:
            raise invalid_request(
                f"model '{model}' gives {own}-dimensional embeddings and cannot shorten them "
                f"(dimensions={dimensions}); leave dimensions out, or send {own}",
                param="dimensions",
            )
        return None

    def _inputs(self, model: str, value: EmbeddingInput) -> tuple[tuple[int, ...], ...]:
        if isinstance(value, str):
            value = [value]
        if not value:
            raise invalid_request("input must not be empty", param="input")
        if all(isinstance(item, int) for item in value):
            value = [value]  # type: ignore[list-item]  # one input of token ids
        if len(value) > MAX_INPUTS:
            raise invalid_request(
                f"a request embeds at most {MAX_INPUTS} inputs, got {len(value)}", param="input"
            )
        if all(isinstance(item, list) for item in value):
            ids = [[int(t) for t in item] for item in value]  # type: ignore[union-attr]
        elif all(isinstance(item, str) for item in value):
            texts = [str(item) for item in value]
            self._check_texts(model, texts)
            ids = self._tokenizers.encode_inputs(model, texts)
        else:
            raise invalid_request(
                "input must be a string, a list of strings, a list of token ids or a list of "
                "token-id lists (not a mix)",
                param="input",
            )
        self._check_tokens(model, ids)
        return tuple(tuple(one) for one in ids)

    def _check_texts(self, model: str, texts: list[str]) -> None:
        """400 for an empty text, and for one that cannot fit the model's input whatever its
        tokens, before anything is tokenized (as completions' prompts: tokenizing is the costly
        part)."""
        context = self._registry.max_model_len(model)
        most = None if context is None else context * self._chars_per_token
        for i, text in enumerate(texts):
            if not text:
                raise invalid_request(f"input {i} is an empty string", param="input")
            if most is not None and len(text) > most:
                raise context_exceeded(
                    f"input {i} has {len(text)} characters; model '{model}' reads at most "
                    f"{context} tokens of it",
                    "input",
                )

    def _check_tokens(self, model: str, ids: list[list[int]]) -> None:
        context = self._registry.max_model_len(model)
        vocab = self._tokenizers.vocab_size(model)
        for i, one in enumerate(ids):
            if not one:
                raise invalid_request(f"input {i} is empty", param="input")
            if any(not 0 <= t < vocab for t in one):
                raise invalid_request(
                    f"input {i}: token ids must be in [0, {vocab})", param="input"
                )
            if context is not None and len(one) > context:
                raise context_exceeded(
                    f"This model's maximum context length is {context} tokens, however you "
                    f"requested {len(one)} tokens in input {i}. Please reduce your input.",
                    "input",
                )
