"""Wire schemas of POST /v1/embeddings (msgspec): the request is the embeddings service's own
(gateway/embeddings/request.py); the answer is OpenAI's list of embedding objects."""

from __future__ import annotations

import base64
from array import array

import msgspec

from gateway.embeddings.request import EmbeddingRequest as EmbeddingRequest
from gateway.embeddings.service import Embedded


class EmbeddingObject(msgspec.Struct, kw_only=True):
    object: str = "embedding"
    index: int
    # A list of floats, or their float32 little-endian bytes in base64 (encoding_format).
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[EmbeddingObject]
    model: str
    usage: EmbeddingUsage


def embedding_list(embedded: Embedded) -> EmbeddingList:
    """The answer in the encoding the request asked for."""
    as_base64 = embedded.prepared.encoding_format == "base64"
    data = [
        EmbeddingObject(
            index=index,
            embedding=base64.b64encode(vector).decode()
            if as_base64
            else array("f", vector).tolist(),
        )
        for index, vector in enumerate(embedded.result.vectors)
    ]
    tokens = embedded.result.prompt_tokens
    return EmbeddingList(
        data=data, model=embedded.prepared.model, usage=EmbeddingUsage(tokens, tokens)
    )
