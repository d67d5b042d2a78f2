"""Whose an adapter loaded through the admin API is: the API key an operator names, by id, or by
a name exactly one live key has (names repeat, ids do not)."""

from __future__ import annotations

from gateway.errors import invalid_request
from gateway.tenancy.keys import KeyRecord, KeyService


async def owner_key(keys: KeyService, name: str | None, key_id: int | None) -> KeyRecord | None:
    """The live key named by `key_id` (and, if given too, `name`) or by `name` alone; None for
    neither (the adapter is every key's); 400 for a key that is unknown, revoked, ambiguous."""
    if key_id is not None:
        key = await keys.get(key_id)
        if key is None or key.revoked:
            raise invalid_request(f"owner_key_id {key_id} is not a live API key",
                                  param="owner_key_id", code="invalid_owner_key")  # fmt: skip
        if name is not None and name != key.name:
            raise invalid_request(f"owner_key {name!r} is not the name of key {key_id}",
                                  param="owner_key", code="invalid_owner_key")  # fmt: skip
        return key
    if name is None:
        return None
    live = [key for key in await keys.list_keys() if key.name == name and not key.revoked]
    if not live:
        raise invalid_request(f"no live API key is named {name!r}", param="owner_key",
                              code="invalid_owner_key")  # fmt: skip
    if len(live) > 1:
        raise invalid_request(
            f"{len(live)} live API keys are named {name!r}: give owner_key_id (one of "
            f"{', '.join(str(key.id) for key in live)})",
            param="owner_key",
            code="invalid_owner_key",
        )
    return live[0]
