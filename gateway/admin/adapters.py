"""LoRA adapters loaded and unloaded at run time by an operator (the admin API), without a site
restart: vLLM's /v1/load_lora_adapter, for the federation.

A load names the adapter, its `parent` (the base model) and its `path`: a PEFT adapter directory
on the site's machine (the gateway sends the path, not the files; put the adapter there first,
on a volume every site of the model mounts for a load on all of them). It goes to the named
`site`, or to every healthy site of the parent; each site checks the adapter against its base
and refuses one that does not fit, changing nothing. An optional `owner_key` makes the adapter
private to that API key's name, as the federation file's `adapters` entries do
(gateway/federation_adapters.py). The catalogue knows the adapter as soon as a site answers: the
site's adapter list is taken from the answer, not from the next health check.

An unload goes to every site that lists the adapter. A site refuses while requests of the
adapter are queued or running there (it does not drain them): the answer says which sites still
serve it, and the operator retries.

Like drains and membership, what this changes lives in the sites and this gateway's memory: a
restarted site serves what its adapter directory holds (a loaded adapter is linked there), and
an owner key given here is forgotten by a restarted gateway (the federation file keeps one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from typing import Annotated

import msgspec

from gateway.errors import (
    Conflict,
    GatewayError,
    InvalidRequest,
    NotFound,
    invalid_request,
    service_unavailable,
)
from gateway.federation_adapters import AdapterConfig
from gateway.model_catalogue import AdapterCatalogue
from gateway.sites.interface import (
    AdapterArchiveLoading,
    AdapterChangeRefused,
    AdapterLoading,
    SiteCallError,
)
from gateway.sites.registry import SiteRegistry, SiteState

log = logging.getLogger(__name__)
_NAME = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


class LoadAdapterBody(msgspec.Struct, forbid_unknown_fields=True):
    name: _NAME
    # A PEFT adapter directory on the site's machine.
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    parent: str
    site: str | None = None
    owner_key: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None


class SiteChangeView(msgspec.Struct, frozen=True, omit_defaults=True):
    site: str
    ok: bool
    error: str | None = None
    # Why not: "invalid" (does not fit the base, a bad path), "exists", "busy" (requests of it
    # are live), "unsupported" (a site kind that cannot), "unreachable".
    reason: str | None = None


class AdapterChangeView(msgspec.Struct, frozen=True):
    name: str
    parent: str
    owner_key: str | None
    # Each site asked, and whether it made the change.
    sites: list[SiteChangeView]


class AdapterAdmin:
    def __init__(
        self, registry: SiteRegistry, catalogue: AdapterCatalogue, generative: frozenset[str]
    ) -> None:
        self._registry = registry
        self._catalogue = catalogue
        self._generative = generative

    @staticmethod
    def parse(body: bytes) -> LoadAdapterBody:
        try:
            return msgspec.json.decode(body, type=LoadAdapterBody)
        except msgspec.ValidationError as exc:
            raise invalid_request(str(exc), code="invalid_adapter") from exc
        except msgspec.DecodeError as exc:
            raise invalid_request(f"the body is not JSON: {exc}") from exc

    async def load(self, body: LoadAdapterBody) -> AdapterChangeView:
        """Loads the adapter on the named site or every healthy site of its parent; an error
        when no site loaded it (the first site's reason), else each site's outcome."""
        sites = self._load_targets(body)
        if body.name in self._registry.served_adapters():
            raise Conflict(f"adapter {body.name!r} is served already; unload it first",
                           param="name", code="adapter_exists")  # fmt: skip
        config = AdapterConfig(body.name, body.parent, body.owner_key)
        earlier = self._catalogue.declared(body.name)
        if earlier is not None and earlier != config:
            raise Conflict(
                f"adapter {body.name!r} is declared with another parent or owner (by the "
                "federation file, or an earlier load)", param="name", code="adapter_exists",
            )  # fmt: skip
        # Declared before any site serves it: a health check in between must not find it
        # without its owner (public for a moment).
        self._catalogue.declare(config)
        outcomes = list(await asyncio.gather(*(self._load_one(s, body) for s in sites)))
        if not any(outcome.ok for outcome in outcomes):
            self._catalogue.forget(body.name)
            raise self._first_error(outcomes)
        log.info("adapter %s loaded from %s on %s", body.name, body.path,
                 ", ".join(o.site for o in outcomes if o.ok))  # fmt: skip
        return AdapterChangeView(body.name, body.parent, body.owner_key, outcomes)

    async def load_archive(
        self, config: AdapterConfig, archive: bytes, sites: Sequence[SiteState]
    ) -> list[SiteChangeView]:
        """Serves an adapter whose files the gateway holds (a fine-tuned model's, kept in its
        file store: gateway/fine_tuning/runner.py) on `sites`, sending each the files; declared
        first, as load declares. Each site's outcome; an error when no site serves it after."""
        earlier = self._catalogue.declared(config.name)
        if earlier is not None and earlier != config:
            raise Conflict(f"adapter {config.name!r} is declared with another parent or owner",
                           param="name", code="adapter_exists")  # fmt: skip
        self._catalogue.declare(config)
        outcomes = list(
            await asyncio.gather(*(self._send_one(site, config.name, archive) for site in sites))
        )
        if outcomes and config.name not in self._registry.served_adapters():
            self._catalogue.forget(config.name)
            raise self._first_error(outcomes)
        return outcomes

    async def unload(self, name: str) -> AdapterChangeView:
        """Unloads the adapter from every site that lists it; an error when none did."""
        sites = [site for site in self._registry.all() if name in site.adapters]
        if not sites:
            raise NotFound(f"no site serves adapter {name!r}", param="name",
                           code="adapter_not_found")  # fmt: skip
        declared = self._catalogue.declared(name)
        outcomes = list(await asyncio.gather(*(self._unload_one(site, name) for site in sites)))
        if not any(outcome.ok for outcome in outcomes):
            raise self._first_error(outcomes)
        if not any(name in site.adapters for site in self._registry.all()):
            self._catalogue.forget(name)
        log.info("adapter %s unloaded from %s", name, ", ".join(o.site for o in outcomes if o.ok))
        parent = declared.parent if declared is not None else sites[0].model
        owner = declared.owner_key if declared is not None else None
        return AdapterChangeView(name, parent, owner, outcomes)

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
        return await _changed(site, client.load_adapter(body.name, body.path))

    async def _send_one(self, site: SiteState, name: str, archive: bytes) -> SiteChangeView:
        client = site.client
        if not isinstance(client, AdapterArchiveLoading):
            return _unsupported(site)
        return await _changed(site, client.load_adapter_archive(name, archive))

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
        _take_adapters(site, served)
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


async def _changed(site: SiteState, change: Awaitable[tuple[str, ...]]) -> SiteChangeView:
    """The outcome of a load at `site`, whose answer (the adapters it serves) is taken in."""
    try:
        served = await change
    except SiteCallError as exc:
        return _refusal(site, exc)
    _take_adapters(site, served)
    return SiteChangeView(site.name, True)


def _refusal(site: SiteState, exc: SiteCallError) -> SiteChangeView:
    message = str(exc).removeprefix(f"site {site.name}: ")
    reason = exc.reason if isinstance(exc, AdapterChangeRefused) else "unreachable"
    return SiteChangeView(site.name, False, message, reason)


def _unsupported(site: SiteState) -> SiteChangeView:
    message = "this kind of site cannot load or unload adapters at run time"
    return SiteChangeView(site.name, False, message, "unsupported")


def _take_adapters(site: SiteState, served: tuple[str, ...]) -> None:
    """The site's adapter list as its answer gives it, for the catalogue at once (the next
    health check would find the same)."""
    if site.info is not None:
        site.info = replace(site.info, adapters=served)
