"""A request's priority class (issue 52, after FineInfer's deferred continuous batching): chat a
person waits on comes before work submitted to run when there is room.

INTERACTIVE is served at once; FLEX (OpenAI's `service_tier: "flex"`) and BATCH (Batches API
items) are background work that fills the capacity interactive load leaves. Lower values are
served first, so the enum sorts in the order the engine admits; a site preempts a running
sequence only for a waiting or running one of a strictly higher class (lower value).

Shared here, not in the engine, so that the gateway can name a class without importing
site_engine (import-linter's gateway-without-site contract); fedllm_contract/request_options.py
re-exports it for the request's options, and site.proto's Priority enum maps to it by member
name (fedllm_contract/proto/options.py).
"""

from __future__ import annotations

import enum


class Priority(enum.IntEnum):
    """A request's class; the default for every caller that names none is INTERACTIVE."""

    INTERACTIVE = 0
    FLEX = 1
    BATCH = 2

    @property
    def label(self) -> str:
        """The lowercase name metrics and wire formats use ("interactive", "flex", "batch")."""
        return self.name.lower()

    @property
    def is_background(self) -> bool:
        """Work that fills idle capacity under the deferral bound (FLEX and BATCH)."""
        return self is not Priority.INTERACTIVE
