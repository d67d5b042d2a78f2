"""LoRA fine-tuning jobs trained on a site's idle cycles (issue 54; docs/engine.md says how).

This package imports torch, transformers and peft (its modules do; this one does not, so the
gRPC layer can name the refusal without them): it is no part of the engine's torch-free
scheduling core, and a site loads it only where fine-tuning is on.
"""

from __future__ import annotations


class FineTuneRefused(ValueError):
    """A job call the site refuses; `code` says which kind (the gRPC layer maps it)."""

    INVALID = "invalid"  # the spec or its files are wrong
    PRECONDITION = "precondition"  # this site cannot train it (disabled, memory)
    NOT_FOUND = "not_found"
    EXISTS = "exists"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
