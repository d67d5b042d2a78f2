"""LoRA adapters loaded and unloaded at run time by an operator (the admin API), without a site
restart: vLLM's /v1/load_lora_adapter, for the federation.

A load names the adapter, its `parent` (the base model) and its `path`: a PEFT adapter directory
on the site's machine (the gateway sends the path, not the files; put the adapter there first,
on a volume every site of the model mounts for a load on all of them). It goes to the named
`site`, or to every healthy site of the parent; each site checks the adapter against its base
and refuses one that does not fit, changing nothing. An optional `owner_key_id` (or
`owner_key`, the name of exactly one live key) makes the adapter private to that API key;
without one it is every key's.
The owner is written to the database (gateway/stores/adapter_owners.py) before any site is
asked, so every gateway of the database, a restarted one, and a load that answers after the
gateway gave up on it (503) all keep it private. The catalogue knows the adapter as soon as a
site answers: the site's adapter list is taken from the answer, not from the next health check.

An unload goes to every site that lists the adapter. A site refuses while requests of the
adapter are queued or running there (it does not drain them): the answer says which sites still
serve it, and the operator retries. The owner goes with the last site's unload; an unload of a
name no site serves drops an owner left by a load that never finished.

A restarted site serves what its adapter directory holds (a loaded adapter is linked there).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Sequence
from typing import Annotated

import msgspec

from gateway.admin.adapter_owner import owner_key
from gateway.db.models import MAX_ROW_ID
from gateway.errors import (
    Conflict,
    GatewayError,
    InvalidRequest,
    NotFound,
    invalid_request,
    service_unavailable,
)
from gateway.model_catalogue import AdapterCatalogue
from gateway.sites.interface import (
    AdapterArchiveLoading,
    AdapterChangeRefused,
    AdapterLoading,
    SiteCallError,
)
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.adapter_owners import Ownership
from gateway.tenancy.keys import KeyService

log = logging.getLogger(__name__)
_NAME = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
# A path in a site's message (its adapter directory, a resolved link): the site's file layout is
# not the operator's business beyond the path they sent, so only its last part is kept.
_SITE_PATH = re.compile(r"/(?:[^/\s'\":]+/)+([^/\s'\":]+)")


class LoadAdapterBody(msgspec.Struct, forbid_unknown_fields=True):
    name: _NAME
    # A PEFT adapter directory on the site's machine.
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    parent: str
    site: str | None = None
    # The key the adapter is private to: by name (exactly one live key of it) or by id.
    owner_key: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    owner_key_id: Annotated[int, msgspec.Meta(ge=1, le=MAX_ROW_ID)] | None = None


class SiteChangeView(msgspec.Struct, frozen=True, omit_defaults=True):
    site: str
    ok: bool
    error: str | None = None
    # Why not: "invalid" (does not fit the base, a bad path, a non-finite weight), "exists",
    # "busy" (requests of it are live), "unsupported" (a site kind that cannot), "unreachable"
    # (no answer in time: the load may still finish there).
    reason: str | None = None


class AdapterChangeView(msgspec.Struct, frozen=True):
    name: str
    parent: str
    owner_key: str | None
    # Each site asked, and whether it made the change.
    sites: list[SiteChangeView]
    # The key it is private to (null with no owner_key: every key's).
    owner_key_id: int | None = None


class AdapterAdmin:
    def __init__(
        self,
        registry: SiteRegistry,
        catalogue: AdapterCatalogue,
        generative: frozenset[str],
        keys: KeyService,
        models: frozenset[str] = frozenset(),
        timeout_s: float = 120.0,
    ) -> None:
        """`generative`: the models an adapter may have as parent; `models`: every model name
        served here (embedding models too), which no adapter may take; `timeout_s`: how long a
        load waits for each site."""
        self._registry = registry
        self._catalogue = catalogue
        self._generative = generative
        self._keys = keys
        self._models = models | generative
        self._timeout_s = timeout_s

    @staticmethod
    def parse(body: bytes) -> LoadAdapterBody:
        try:
            parsed = msgspec.json.decode(body, type=LoadAdapterBody)
        except msgspec.ValidationError as exc:
            raise invalid_request(str(exc), code="invalid_adapter") from exc
        except msgspec.DecodeError as exc:
            raise invalid_request(f"the body is not JSON: {exc}") from exc
        if not parsed.path.isprintable():  # a NUL: the site's file calls fail on it (was 503)
            raise invalid_request("path must not hold control characters (NUL among them)",
                                  param="path", code="invalid_adapter")  # fmt: skip
        return parsed

    async def load(
        self, body: LoadAdapterBody, ownership: Ownership | None = None
    ) -> AdapterChangeView:
        """Loads the adapter on the named site or every healthy site of its parent; an error
        when no site loaded it (the first site's reason), else each site's outcome.
        `ownership`: the owner as the caller resolved it (a fine-tuning job's key), instead of
        the body's owner_key(_id)."""
        sites = self._load_targets(body)
        self._check_name_free(body.name)
        owner_name = body.owner_key
        if ownership is None:
            key = await owner_key(self._keys, body.owner_key, body.owner_key_id)
            owner_name = key.name if key is not None else None
            ownership = Ownership(body.name, body.parent, key is None, key.id if key else None)
        # Declared before any site serves it: a health check in between, another gateway, or a
        # load that finishes after this one gave up must not find it without its owner.
        created = await self._claim(body, ownership, owner_name)
        outcomes = list(await asyncio.gather(*(self._load_one(s, body) for s in sites)))
        if not any(outcome.ok for outcome in outcomes):
            # A site that did not answer may still load it: its owner stays, so it stays private.
            if created and all(outcome.reason != "unreachable" for outcome in outcomes):
                await self._catalogue.forget(body.name)
            raise self._first_error(outcomes)
        log.info("adapter %s loaded from %s on %s", body.name, body.path,
                 ", ".join(o.site for o in outcomes if o.ok))  # fmt: skip
        return AdapterChangeView(body.name, body.parent, owner_name, outcomes, ownership.key_id)

    async def load_archive(
        self, ownership: Ownership, archive: bytes, sites: Sequence[SiteState]
    ) -> list[SiteChangeView]:
        """Serves an adapter whose files the gateway holds (a fine-tuned model's, kept in its
        file store: gateway/fine_tuning/runner.py) on `sites`, sending each the files; its owner
        declared first, as load declares (and kept: the model is its job's). Each site's
        outcome; an error when no site serves it after."""
        if self._catalogue.stored(ownership.name) != ownership:
            await self._catalogue.declare(ownership)
        name = ownership.name
        outcomes = list(
            await asyncio.gather(*(self._send_one(site, name, archive) for site in sites))
        )
        if outcomes and name not in self._registry.served_adapters():
            raise self._first_error(outcomes)
        return outcomes

    async def unload(self, name: str) -> AdapterChangeView:
        """Unloads the adapter from every site that lists it; an error when none did. A name no
        site lists loses the owner an unfinished load left, if any."""
        sites = [site for site in self._registry.all() if name in site.adapters]
        if not sites:
            await self._catalogue.refresh()  # an unfinished load's owner, whichever gateway's
        stored = self._catalogue.stored(name)
        in_file = self._catalogue.in_file(name)
        owner = in_file.owner_key if in_file is not None else None
        owner_id = stored.key_id if stored is not None else None
        if in_file is not None and in_file.owner_key_id is not None:
            owner_id = in_file.owner_key_id
        if not sites:
            if stored is None or in_file is not None:
                raise NotFound(f"no site serves adapter {name!r}", param="name",
                               code="adapter_not_found")  # fmt: skip
            await self._catalogue.forget(name)
            return AdapterChangeView(name, stored.parent, owner, [], owner_id)
        parent = self._catalogue.parent_of(name) or sites[0].model
        outcomes = list(await asyncio.gather(*(self._unload_one(site, name) for site in sites)))
        if not any(outcome.ok for outcome in outcomes):
            raise self._first_error(outcomes)
        if not any(name in site.adapters for site in self._registry.all()):
            await self._catalogue.forget(name)
        log.info("adapter %s unloaded from %s", name, ", ".join(o.site for o in outcomes if o.ok))
        return AdapterChangeView(name, parent, owner, outcomes, owner_id)

    async def check_key_name(self, name: str) -> None:
        """Before a key is made: 409 when the federation file gives adapters to keys of this
        name and a live key has it already. Such an owner stands for that (oldest) key alone,
        so a second key of the name would not get them, which is not what naming it says."""
        if name not in self._catalogue.file_owner_names():
            return
        live = [
            key.id for key in await self._keys.list_keys() if key.name == name and not key.revoked
        ]
        if live:
            raise Conflict(
                f"the federation file gives adapters to the key named {name!r}, which key "
                f"{live[0]} is: a second live key of that name would not get them. Name the key "
                "otherwise, or revoke that one first",
                param="name",
                code="key_name_taken",
            )

    async def key_made(self) -> None:
        """A key was made: the federation file's owners by name are read again (the first
        key of such a name may use its adapters at once, on this gateway)."""
        await self._catalogue.refresh()

    def _check_name_free(self, name: str) -> None:
        if name in self._models:
            raise Conflict(f"{name!r} is the name of a model served here", param="name",
                           code="adapter_exists")  # fmt: skip
        if name in self._registry.served_adapters():
            raise Conflict(f"adapter {name!r} is served already; unload it first",
                           param="name", code="adapter_exists")  # fmt: skip

    async def _claim(
        self, body: LoadAdapterBody, ownership: Ownership, owner_name: str | None
    ) -> bool:
        """Writes the adapter's owner; whether this load wrote it (False: the federation file,
        or an earlier unfinished load, declared the same). 409 for another parent or owner."""
        in_file = self._catalogue.in_file(body.name)
        if in_file is not None:
            same_owner = (
                in_file.owner_key_id == ownership.key_id
                if in_file.owner_key_id is not None
                else in_file.owner_key == owner_name
            )
            if in_file.parent != body.parent or not same_owner:
                raise Conflict(f"adapter {body.name!r} is declared with another parent or "
                               "owner by the federation file", param="name",
                               code="adapter_exists")  # fmt: skip
            return False
        await self._catalogue.refresh()  # another gateway's unfinished load of the name, too
        earlier = self._catalogue.stored(body.name)
        if earlier == ownership:
            return False
        if earlier is not None:
            raise Conflict(
                f"adapter {body.name!r} has another parent or owner from an earlier load that no "
                "site finished; DELETE it first to drop that owner", param="name",
                code="adapter_exists",
            )  # fmt: skip
        await self._catalogue.declare(ownership)
        return True

    def _load_targets(self, body: LoadAdapterBody) -> list[SiteState]:
        if body.parent not in self._generative:
            raise invalid_request(f"parent {body.parent!r} is not a generative model served here",
                                  param="parent", code="model_not_found")  # fmt: skip
        if body.site is None:
            sites = [s for s in self._registry.all() if s.model == body.parent and s.healthy]
            if not sites:
                raise service_unavailable(f"no healthy site serves {body.parent!r} now")
            return sites
        site = self._registry.get(body.site)
        if site is None:
            raise NotFound(f"no site named {body.site!r}", param="site", code="site_not_found")
        if site.model != body.parent:
            raise invalid_request(f"site {body.site!r} serves {site.model!r}, not the parent "
                                  f"{body.parent!r}", param="site")  # fmt: skip
        return [site]

    async def _load_one(self, site: SiteState, body: LoadAdapterBody) -> SiteChangeView:
        client = site.client
        if not isinstance(client, AdapterLoading):
            return _unsupported(site)
        return await self._changed(site, client.load_adapter(body.name, body.path))

    async def _send_one(self, site: SiteState, name: str, archive: bytes) -> SiteChangeView:
        client = site.client
        if not isinstance(client, AdapterArchiveLoading):
            return _unsupported(site)
        return await self._changed(site, client.load_adapter_archive(name, archive))

    async def _changed(self, site: SiteState, change: Awaitable[tuple[str, ...]]) -> SiteChangeView:
        """The outcome of a load at `site`, whose answer (the adapters it serves) is taken in;
        "unreachable" past the load timeout."""
        try:
            served = await asyncio.wait_for(change, self._timeout_s)
        except TimeoutError:
            message = (f"no answer in {self._timeout_s:g} s; the load may still finish there "
                       "(the adapter keeps the owner this load gave it)")  # fmt: skip
            return SiteChangeView(site.name, False, message, "unreachable")
        except SiteCallError as exc:
            return _refusal(site, exc)
        site.take_adapters(served)
        return SiteChangeView(site.name, True)

    async def _unload_one(self, site: SiteState, name: str) -> SiteChangeView:
        client = site.client
        if not isinstance(client, AdapterLoading):
            return _unsupported(site)
        try:
            served = await client.unload_adapter(name)
        except AdapterChangeRefused as exc:
            if exc.reason != "not_found":  # gone already: the unload's aim
                return _refusal(site, exc)
            served = tuple(a for a in site.adapters if a != name)
        except SiteCallError as exc:
            return _refusal(site, exc)
        site.take_adapters(served)
        return SiteChangeView(site.name, True)

    @staticmethod
    def _first_error(outcomes: list[SiteChangeView]) -> GatewayError:
        """The error of a change no site made: the kind of the first site's refusal."""
        first = outcomes[0]
        message = f"site {first.site}: {first.error}"
        if len(outcomes) > 1:
            message += f" (and {len(outcomes) - 1} other site(s) refused too)"
        reason = first.reason
        if reason in ("invalid", "unsupported"):
            return InvalidRequest(message, param="path", code="invalid_adapter")
        if reason in ("exists", "busy"):
            return Conflict(message, param="name", code=f"adapter_{reason}")
        return service_unavailable(message)


def _refusal(site: SiteState, exc: SiteCallError) -> SiteChangeView:
    message = _SITE_PATH.sub(r"\1", str(exc).removeprefix(f"site {site.name}: "))
    reason = exc.reason if isinstance(exc, AdapterChangeRefused) else "unreachable"
    return SiteChangeView(site.name, False, message, reason)


def _unsupported(site: SiteState) -> SiteChangeView:
    message = "this kind of site cannot load or unload adapters at run time"
    return SiteChangeView(site.name, False, message, "unsupported")
