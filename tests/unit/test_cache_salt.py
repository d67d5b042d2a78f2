"""The prefix-cache salt the gateway sends with each request, and where it is configured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.completions.cache_salt import cache_salt
from gateway.federation import parse_federation


def test_the_salt_is_per_key_unless_shared_and_a_client_salt_only_splits() -> None:
    per_key = {cache_salt(key, None, share_across_keys=False) for key in (1, 2)}
    assert len(per_key) == 2
    assert all(len(salt) == 32 for salt in per_key)
    assert cache_salt(1, None, False) == cache_salt(1, None, False)  # stable across calls
    # Shared models and anonymous callers have no tenant part.
    assert cache_salt(1, None, True) == cache_salt(2, None, True) == ""
    assert cache_salt(None, None, False) == ""
    # A client's salt is mixed with its key's, never instead of it.
    mixed = {cache_salt(key, "x", False) for key in (1, 2)}
    assert len(mixed) == 2
    assert not mixed & per_key
    assert cache_salt(1, "x", True) == cache_salt(2, "x", True) != ""
    assert cache_salt(1, "", False) == cache_salt(1, None, False)


def test_share_prefix_cache_is_a_per_model_opt_in(tmp_path: Path) -> None:
    models: list[dict[str, Any]] = [
        {"name": "a", "tokenizer": "t"},
        {"name": "b", "tokenizer": "t", "share_prefix_cache": True},
    ]
    sites = [
        {"name": f"s-{m['name']}", "cloud": "c", "region": "r", "endpoint": "h:1"}
        | {"model": m["name"]}
        for m in models
    ]
    config = parse_federation(json.dumps({"models": models, "sites": sites}).encode(), tmp_path)
    assert {m.name: m.share_prefix_cache for m in config.models} == {"a": False, "b": True}
