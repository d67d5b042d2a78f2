"""What a client asks of /v1/embeddings (msgspec, decoded at the HTTP edge)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.completions.request import Prompt

# OpenAI's forms of `input`: a string, a list of strings, a list of token ids, or a list of
# token-id lists (one array type per msgspec union: prepare checks the list is of one kind).
EmbeddingInput = Prompt


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/embeddings."""

    model: str
    input: EmbeddingInput
    # "float" (OpenAI's default) or "base64" (what the openai SDKs ask for, then decode).
    encoding_format: str = "float"
    dimensions: int | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
