"""The prefix-cache salt each request carries to its site (GenerateRequest.cache_salt).

A site shares cached KV blocks only between requests of the same salt (the salt seeds the block
ids, fedllm_contract/block_hash.py), so the salt decides who can learn what from a cache hit:
with shared blocks, a request's time to first token tells whether its prefix was cached, i.e.
sent by someone else before. By default the salt is per API key (derived from the key's id,
never its secret): a tenant's cache hits come from its own requests only. A model whose
federation entry sets `share_prefix_cache` leaves the key out, so a deployment's common system
prompt is computed once for everyone, at that cost. A client may add its own `cache_salt`
(vLLM's field) to split its key's cache further; it is mixed with the key's part, never
replaces it. Without keys (GATEWAY_REQUIRE_API_KEYS=false) anonymous callers share.
"""

from __future__ import annotations

import hashlib
import json

SALT_SCHEME = "fedllm-cache-salt-v1"
# What a client's cache_salt may hold; the site receives a 32-character digest whatever it is.
MAX_CLIENT_SALT_CHARS = 256


def cache_salt(api_key_id: int | None, client_salt: str | None, share_across_keys: bool) -> str:
    """The salt for a request of key `api_key_id` (None: anonymous); "" when nothing splits
    the cache (the site's shared chains)."""
    tenant = None if share_across_keys else api_key_id
    if tenant is None and not client_salt:
        return ""
    key = json.dumps([SALT_SCHEME, tenant, client_salt or ""], separators=(",", ":"))
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
