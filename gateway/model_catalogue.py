"""What a request's `model` names: a base model of the federation file, or a LoRA adapter a
healthy site serves over its base (vLLM's convention: an adapter is a model of its own name).

The sites say which adapters they serve (SiteInfo.adapters, refreshed by every health check),
by name only. Who may use one is declared by the federation file (gateway/federation_adapters.py:
every key, one key by id, or by a name, which stands for the oldest live key of that name) or,
for an adapter loaded at run time (gateway/admin/adapters.py) and a fine-tuned model (`ft:...`,
gateway/fine_tuning/), by a row of the database (gateway/stores/adapter_owners.py: every key, or
one key by id), which every gateway of the database reads (at its start, then every
`refresh_s`, and at once after a key is made here). An adapter nothing declares is nobody's:
a site's own, or one another gateway loaded a moment ago, is refused until it is declared, never
served to everyone. An adapter a key may not use is, to that key, a model that does not exist.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.federation_adapters import AdapterConfig
from gateway.sites.registry import SiteRegistry
from gateway.stores.adapter_owners import AdapterOwnerStore, Ownership

log = logging.getLogger(__name__)

# The names of fine-tuned models (gateway/fine_tuning/runner.py names them).
FINE_TUNED_PREFIX = "ft:"


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    name: str
    # Its base model (the model of the sites that serve it).
    parent: str


class AdapterCatalogue:
    def __init__(
        self,
        registry: SiteRegistry,
        in_file: Iterable[AdapterConfig] = (),
        owners: AdapterOwnerStore | None = None,
    ) -> None:
        """`owners`: the database's rows (None: only this gateway's memory, as unit tests use)."""
        self._registry = registry
        self._in_file = {adapter.name: adapter for adapter in in_file}
        self._owners = owners
        self._stored: dict[str, Ownership] = {}
        # The federation file's owners by key name -> the key each stands for (its oldest live
        # key), read with the owners' rows. A name no live key has yet stands for no one.
        self._file_owner_ids: dict[str, int] = {}
        # Held by each change this gateway makes (memory and row) and by each refresh's read: a
        # refresh whose read ended while a change's row was still being written found no newer
        # change, wrote memory without the row, and the model was gone from /v1/models until the
        # next refresh (a fine-tuned model missing right after its job succeeded: CI, issue 72).
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        """The database's owners, as every gateway of it wrote them."""
        if self._owners is None:
            return
        async with self._lock:
            rows = await self._owners.all()
            owner_ids = await self._owners.oldest_live_keys(self.file_owner_names())
            self._stored = {row.name: row for row in rows}
            self._file_owner_ids = owner_ids

    async def run(self, refresh_s: float) -> None:
        while True:
            await asyncio.sleep(refresh_s)
            try:
                await self.refresh()
            except Exception:  # the database away: the owners known stay, next pass retries
                log.exception("adapter owners not refreshed")

    async def declare(self, ownership: Ownership) -> None:
        """An adapter loaded at run time, with its owner: written before any site serves it."""
        async with self._lock:
            self._stored[ownership.name] = ownership
            if self._owners is not None:
                await self._owners.put(ownership)

    async def forget(self, name: str) -> None:
        """An adapter no site serves any more (the federation file's stays declared)."""
        async with self._lock:
            self._stored.pop(name, None)
            if self._owners is not None:
                await self._owners.remove(name)

    def in_file(self, name: str) -> AdapterConfig | None:
        return self._in_file.get(name)

    def file_owner_names(self) -> frozenset[str]:
        """The key names the federation file gives adapters to."""
        return frozenset(a.owner_key for a in self._in_file.values() if a.owner_key is not None)

    def stored(self, name: str) -> Ownership | None:
        return self._stored.get(name)

    def parent_of(self, name: str) -> str | None:
        """The base model the declarations give the adapter (None: undeclared)."""
        declared = self._in_file.get(name) or self._stored.get(name)
        return declared.parent if declared is not None else None

    def served(self, key_id: int | None, key_name: str | None) -> list[ServedAdapter]:
        """The adapters healthy sites serve now that the key may use, by name."""
        found = (self.find(name) for name in self._registry.served_adapters())
        return sorted(
            (a for a in found if a is not None and self.may_use(a.name, key_id, key_name)),
            key=lambda a: a.name,
        )

    def find(self, name: str) -> ServedAdapter | None:
        """The adapter `name` names, whoever owns it; None when no healthy site serves it (over
        the parent its declaration gives it)."""
        parent = self._registry.served_adapters().get(name)
        if parent is None:
            return None
        declared = self.parent_of(name)
        if declared is not None:
            if not self._registry.serves_adapter(declared, name):
                return None
            parent = declared
        return ServedAdapter(name, parent)

    def may_use(self, adapter: str, key_id: int | None, key_name: str | None) -> bool:
        """Whether the key (its id and name; None, None: no key) may use the adapter. Owners
        are key ids: the database's, the federation file's `owner_key_id`, and the oldest live
        key of the file's `owner_key` name (another key of that name is not it). A catalogue
        without a database (unit tests) has no ids for names and goes by the name."""
        in_file = self._in_file.get(adapter)
        if in_file is not None:
            if in_file.owner_key_id is not None:
                return key_id == in_file.owner_key_id
            if in_file.owner_key is None:
                return True
            if self._owners is None:
                return in_file.owner_key == key_name
            owner_id = self._file_owner_ids.get(in_file.owner_key)
            return owner_id is not None and key_id == owner_id
        stored = self._stored.get(adapter)
        if stored is None:
            return False  # declared by no one: no one's
        return stored.public or stored.key_id == key_id
