"""The Responses API's parameters this gateway does not serve, refused by name unless they hold
their neutral value (as chat's `_NEUTRAL_ONLY`): a client that leaves them at their default
passes, one that asks for the feature learns that it is not there, and nothing is dispatched."""

from __future__ import annotations

from typing import Any

from gateway.errors import Unserved, invalid_request, refuse_unserved
from gateway.responses.request import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    ResponseCreateRequest,
)


def _no_reasoning(value: dict[str, Any] | None) -> bool:
    return value is None or all(v is None for v in value.values())


# param -> (is the value one this gateway honours, what to say when it is not)
_NEUTRAL_ONLY: Unserved = {
    "background": (lambda v: not v, "background responses are not offered; send the request "
                   "and read its answer (or stream it)"),
    "include": (lambda v: not v, "no extra output data (logprobs, encrypted reasoning, tool "
                "sources) is offered"),
    "reasoning": (_no_reasoning, "this gateway's models do not reason separately"),
    "truncation": (lambda v: v in (None, "disabled"), "a conversation too long for the model's "
                   "context is refused, never cut ('disabled')"),
    "service_tier": (lambda v: v in (None, "auto", "default", "flex"), "the service tiers "
                     "offered are auto, default and flex"),
    "top_logprobs": (lambda v: not v, "logprobs are not offered on this endpoint (use "
                     "/v1/chat/completions)"),
    "prompt": (lambda v: v is None, "stored prompt templates are not offered"),
    "conversation": (lambda v: v is None, "the Conversations API is not offered: use "
                     "previous_response_id"),
}  # fmt: skip


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid_request(
            f"metadata holds at most {MAX_METADATA_PAIRS} pairs", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid_request(
                f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values at "
                f"most {MAX_METADATA_VALUE_CHARS}",
                param=f"metadata.{key[:MAX_METADATA_KEY_CHARS]}",
            )


def reject_unsupported(req: ResponseCreateRequest) -> None:
    refuse_unserved(req, _NEUTRAL_ONLY)
    if req.stream_options is not None and not req.stream:
        raise invalid_request("stream_options needs stream: true", param="stream_options")
    _check_metadata(req.metadata)
