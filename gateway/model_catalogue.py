"""What a request's `model` names: a base model of the federation file, or a LoRA adapter a
healthy site serves over its base (vLLM's convention: an adapter is a model of its own name).

The sites say which adapters they serve (SiteInfo.adapters, refreshed by every health check);
the federation file may give one a parent and an owner key (gateway/federation_adapters.py),
and so may an operator who loads one at run time (gateway/admin/adapters.py).
An adapter private to a key is, to every other key, a model that does not exist. A fine-tuned
model (`ft:...`, gateway/fine_tuning/) is its key's own: until the job's owner is declared (a
moment after a site lists it, on a gateway that did not load it) it is nobody's, never everyone's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.federation_adapters import AdapterConfig
from gateway.sites.registry import SiteRegistry

# The names of fine-tuned models (gateway/fine_tuning/runner.py names them).
FINE_TUNED_PREFIX = "ft:"


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    name: str
    # Its base model (the model of the sites that serve it).
    parent: str


class AdapterCatalogue:
    def __init__(self, registry: SiteRegistry, declared: Iterable[AdapterConfig] = ()) -> None:
        self._registry = registry
        self._declared = {adapter.name: adapter for adapter in declared}
        self._in_file = frozenset(self._declared)

    def declare(self, adapter: AdapterConfig) -> None:
        """An adapter loaded at run time: its parent and owner, as the file would give them."""
        self._declared[adapter.name] = adapter

    def forget(self, name: str) -> None:
        """An adapter unloaded everywhere: a run-time declaration goes (the file's stays)."""
        if name not in self._in_file:
            self._declared.pop(name, None)

    def declared(self, name: str) -> AdapterConfig | None:
        return self._declared.get(name)

    def served(self, key_name: str | None) -> list[ServedAdapter]:
        """The adapters healthy sites serve now that the key may use, by name."""
        found = (self.find(name) for name in self._registry.served_adapters())
        return sorted(
            (a for a in found if a is not None and self.may_use(a.name, key_name)),
            key=lambda a: a.name,
        )

    def find(self, name: str) -> ServedAdapter | None:
        """The adapter `name` names, whoever owns it; None when no healthy site serves it (over
        the parent the federation file gives it)."""
        parent = self._registry.served_adapters().get(name)
        if parent is None:
            return None
        declared = self._declared.get(name)
        if declared is not None:
            if not self._registry.serves_adapter(declared.parent, name):
                return None
            parent = declared.parent
        return ServedAdapter(name, parent)

    def may_use(self, adapter: str, key_name: str | None) -> bool:
        """Whether the key (by name; None: no key) may use the adapter: one without an owner in
        the federation file is every key's, but for an undeclared fine-tuned model."""
        declared = self._declared.get(adapter)
        if declared is None:
            return not adapter.startswith(FINE_TUNED_PREFIX)
        return declared.owner_key in (None, key_name)
