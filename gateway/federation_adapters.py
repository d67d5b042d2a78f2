"""The federation file's `adapters`: what the operator says of LoRA adapters the sites serve.

A site lists the adapters it serves (its SiteInfo), by name only; the gateway serves each under
its own name as a model over the site's base, to the keys a declaration allows: an entry here,
or for adapters loaded at run time the database (gateway/stores/adapter_owners.py). One nothing
declares is no one's. An entry names an adapter's `parent` (its base model: only sites of that
model serve it) and, optionally, its owner: `owner_key_id`, the id of the one API key that may
use it, or `owner_key`, a key's name, which stands for one key too: the oldest live key of that
name (gateway/model_catalogue.py), and the admin API refuses a second live key of a name an
adapter's owner has (issue 67: a second key of the same name got the adapters). Without either,
every key's. Any other key, or a request without a key, gets the same 404 as for an unknown
model and does not see it in /v1/models:

    "adapters": [{"name": "acme-support", "parent": "tiny-llama", "owner_key_id": 3}]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

import msgspec

_NAME = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
# Key ids are 32-bit integer columns (gateway/db/models/base.py, MAX_ROW_ID).
_KEY_ID = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]


class AdapterEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: _NAME
    parent: str
    owner_key: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    owner_key_id: _KEY_ID | None = None


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    name: str
    parent: str
    # The API key name whose oldest live key alone may use the adapter; None: see owner_key_id.
    owner_key: str | None = None
    # The id of the API key that alone may use it; None with no owner_key: every key.
    owner_key_id: int | None = None


def check_adapters(
    entries: Iterable[AdapterEntry], generative_models: Iterable[str], all_models: Iterable[str]
) -> tuple[AdapterConfig, ...]:
    """The entries as configs; ValueError naming the entry for a parent that is not a generative
    model, a name taken by a model, a name given twice (which owner would hold?), or an owner
    given both by id and by name."""
    generative, models = set(generative_models), set(all_models)
    adapters = tuple(AdapterConfig(e.name, e.parent, e.owner_key, e.owner_key_id) for e in entries)
    names = [a.name for a in adapters]
    for adapter in adapters:
        where = f"adapter {adapter.name!r}"
        if adapter.owner_key is not None and adapter.owner_key_id is not None:
            raise ValueError(f"{where}: give owner_key_id or owner_key, not both")
        if adapter.parent not in generative:
            raise ValueError(
                f"{where}: parent {adapter.parent!r} is not a generative model of 'models'"
            )
        if adapter.name in models:
            raise ValueError(f"{where}: the name is a model's; an adapter needs its own")
        if names.count(adapter.name) > 1:
            raise ValueError(f"{where} is given more than once")
    return adapters
