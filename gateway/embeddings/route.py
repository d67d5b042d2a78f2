"""Where an embeddings request goes: among the healthy sites serving its model, not drained and
within the gateway's queue bounds, the one with the least token load for its capacity
(`least_tokens`: the site's reported queue and work against this gateway's own ledger, the larger
of the two), equal sites taking turns. Built from the routing catalogue's parts, not a policy
of its own: an embedding has no answer to predict, so token load is the whole of its cost, and
GATEWAY_ROUTING_POLICY (which plans answers) does not apply."""

from __future__ import annotations

from collections.abc import Collection

from gateway.embeddings.prepare import PreparedEmbedding
from gateway.metrics import GatewayMetrics
from gateway.routing.catalogue import BuildContext, build_profile
from gateway.routing.policy import Decision
from gateway.routing.profile_settings import PartSettings, ProfileSettings
from gateway.routing.types import RoutingRequest
from gateway.sites.registry import SiteRegistry, SiteState

EMBEDDING_PROFILE = ProfileSettings(
    "embeddings",
    (
        PartSettings("serves_model"),
        PartSettings("healthy"),
        PartSettings("not_draining"),
        PartSettings("queue_bound"),
    ),
    (PartSettings("least_tokens"),),
    PartSettings("max_score"),
)


def routing_request(prepared: PreparedEmbedding) -> RoutingRequest:
    """The request as routing weighs it: its input tokens, no answer."""
    return RoutingRequest(
        model=prepared.model,
        prompt_tokens=prepared.prompt_tokens,
        max_tokens=0,
        unpredicted="prompt_only",
    )


class EmbeddingRouter:
    def __init__(
        self,
        registry: SiteRegistry,
        metrics: GatewayMetrics,
        max_site_queue: int | None = None,
        max_site_queued_tokens: int | None = None,
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._profile = build_profile(
            EMBEDDING_PROFILE, BuildContext(max_site_queue, max_site_queued_tokens)
        )

    def route(
        self, prepared: PreparedEmbedding, excluded: Collection[str] = ()
    ) -> Decision[SiteState]:
        """The site for the request, none of `excluded` (decision.site None: none can take it
        now); counted in the routing metrics."""
        sites = [site for site in self._registry.all() if site.name not in excluded]
        decision = self._profile.route(routing_request(prepared), sites)
        site = decision.site
        self._metrics.routed(self._profile.name, site.name if site is not None else None)
        return decision
