"""The load numbers a site exports as gauges of its own and the gateway again per site, from the
site's load reports: one name and one meaning on both sides (docs/metrics.md lists them)."""

from __future__ import annotations

# (name, help): each is an attribute of the same name of the engine's stats and of the gateway's
# view of a load report.
SHARED_LOAD_GAUGES: tuple[tuple[str, str], ...] = (
    ("queued_prompt_tokens", "Prompt tokens of the waiting requests"),
    ("running_tokens", "Tokens held by running sequences (KV)"),
    ("predicted_remaining_tokens", "Predicted answer tokens still to generate"),
    ("kv_blocks_used", "KV-cache blocks in use"),
    ("kv_blocks_total", "KV-cache blocks in all"),
)
