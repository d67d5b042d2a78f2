"""The routing policy a gateway runs: a profile chosen by name (GATEWAY_ROUTING_POLICY) among the
built-in ones and those the federation file defines (gateway/routing/catalogue.py)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.adapter_affinity import AdapterRouting
from gateway.routing.catalogue import BUILT_IN, BuildContext, build_profile
from gateway.routing.profile import Decision as Decision
from gateway.routing.profile import RoutingProfile
from gateway.routing.profile_settings import ProfileSettings

# What a gateway routes with; the name policies had before they became profiles.
RoutingPolicy = RoutingProfile

POLICY_NAMES = tuple(BUILT_IN)


def build_policy(
    name: str,
    max_site_queue: int | None = None,
    max_site_queued_tokens: int | None = None,
    custom: Sequence[ProfileSettings] = (),
    adapter_routing: AdapterRouting = "affinity",
) -> RoutingPolicy:
    """Contract: a fresh profile (own turn counters and tables) for a built-in name or one of
    `custom`'s; ValueError for any other name. Every built-in profile leaves out draining sites
    and sites whose queue reached the bounds (None: unbounded); `adapter_routing` "blind" turns
    off every part's use of where adapters are."""
    profiles = {**BUILT_IN, **{profile.name: profile for profile in custom}}
    settings = profiles.get(name)
    if settings is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(profiles)}")
    context = BuildContext(max_site_queue, max_site_queued_tokens, adapter_routing)
    return build_profile(settings, context)
