"""Wire schemas of the admin API for client keys (msgspec). The ORM model is ApiKey in
gateway/db/models.py; times are Unix seconds, as in OpenAI's objects."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# Limits are stored as 32-bit integers.
PerMinute = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
InFlight = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]


class KeyCreateRequest(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    # Absent or null: unlimited.
    requests_per_minute: PerMinute | None = None
    tokens_per_minute: PerMinute | None = None
    max_concurrent_requests: InFlight | None = None


class ApiKeyObject(msgspec.Struct, kw_only=True):
    id: int
    object: Literal["api_key"] = "api_key"
    name: str
    # The key's first characters, to recognise it by; the key itself is never shown again.
    prefix: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent_requests: int | None
    created_at: int
    revoked_at: int | None


class CreatedApiKey(ApiKeyObject, kw_only=True):
    # The plaintext key: returned by the create call only.
    key: str


class ApiKeyList(msgspec.Struct):
    data: list[ApiKeyObject]
    object: Literal["list"] = "list"


class ModelUsageObject(msgspec.Struct):
    """A key's usage of one model, or of one LoRA adapter over it (`adapter` null: the base)."""

    model: str
    adapter: str | None
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ApiKeyUsage(msgspec.Struct):
    api_key_id: int
    window_s: int
    since: int
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    object: Literal["api_key.usage"] = "api_key.usage"
    # The same per model and adapter.
    models: list[ModelUsageObject] = msgspec.field(default_factory=list)
    # Tokens trained by the key's fine-tuning jobs made in the window (a running job's so
    # far): what its sites ran forward and backward, billed apart from requests' tokens.
    trained_tokens: int = 0
