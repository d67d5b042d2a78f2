"""Wire schemas of the OpenAI-compatible API (msgspec). The completion request and the completion
object are the completion service's own (gateway/completions/request.py and result.py: batches
store them too); the ORM models are separate."""

from __future__ import annotations

import msgspec

from gateway.completions.request import CompletionRequest as CompletionRequest
from gateway.completions.request import Prompt as Prompt
from gateway.completions.request import StreamOptions as StreamOptions
from gateway.completions.result import Completion as Completion
from gateway.completions.result import CompletionChoice as CompletionChoice
from gateway.completions.result import Usage as Usage


class ModelCard(msgspec.Struct):
    id: str
    created: int = 0
    owned_by: str = "fedllm"
    object: str = "model"
    # The model it derives from, as vLLM and OpenAI's fine-tunes say it: a LoRA adapter's
    # base as both `root` and `parent`; a base model is its own root and has no parent.
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
