"""Stage 4, route: the site a request goes to, by the gateway's routing profile
(gateway/routing/) among the sites able to do what the request asks; and, for dispatch
(gateway/dispatch/accounting.py: Placement), another site when the one it is on cannot go on."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.dispatch.request import PreparedCompletion
from gateway.errors import invalid_request
from gateway.metrics import GatewayMetrics
from gateway.routing.policy import Decision, RoutingPolicy
from gateway.routing.types import RoutingRequest
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.tokenizers import ModelTokenizers

# The request parameter behind each site capability, for the 400 of a request no site can do.
_CAPABILITY_PARAM = {
    "penalties": "presence_penalty",
    "json_schema": "response_format",
    "json_object": "response_format",
    "tagged_json": "tool_choice",
}


class Router:
    """Owns the routing profile requests are placed by; counts each decision in the metrics."""

    def __init__(
        self,
        registry: SiteRegistry,
        policy: RoutingPolicy,
        tokenizers: ModelTokenizers,
        metrics: GatewayMetrics,
    ) -> None:
        self.registry = registry
        self._policy = policy
        self._tokenizers = tokenizers
        self._metrics = metrics

    @property
    def policy(self) -> RoutingPolicy:
        """The routing profile requests are placed by (the batch API assigns by its cost)."""
        return self._policy

    def route(self, prepared: PreparedCompletion) -> Decision[SiteState]:
        """The site for a new request (decision.site None: no site can take it now), counted
        in the metrics; 400 when no site of its model can do what it asks."""
        decision = self.decide(prepared)
        self.count(decision)
        return decision

    def decide(
        self, prepared: PreparedCompletion, routing: RoutingRequest | None = None
    ) -> Decision[SiteState]:
        """route() without counting the decision (the gateway's queue counts the one that
        found a site, not each pass that found none)."""
        return self._policy.route(routing or prepared.routing, self.able_sites(prepared))

    def count(self, decision: Decision[SiteState]) -> None:
        site = decision.site
        self._metrics.routed(self._policy.name, site.name if site is not None else None)

    def reroute(
        self,
        prepared: PreparedCompletion,
        excluded: set[str],
        routing: RoutingRequest | None = None,
    ) -> SiteState | None:
        """Another site for the request, not one of `excluded` (`routing`: a continuation's
        prompt and answer left)."""
        others = [site for site in self.able_sites(prepared) if site.name not in excluded]
        return self._policy.route(routing or prepared.routing, others).site

    def decode_answer(self, model: str, token_ids: Sequence[int]) -> str:
        """Answer tokens as the sites' detokenizer writes them (where a continuation resumes)."""
        return self._tokenizers.decode_answer(model, list(token_ids))

    def token_bytes(self, model: str, token_id: int) -> bytes:
        """A token's own bytes, as its tokenizer maps it (logprobs' `bytes`)."""
        return self._tokenizers.token_bytes(model, token_id)

    def able_sites(self, prepared: PreparedCompletion) -> list[SiteState]:
        """The sites that can do what the request needs (n, logprobs, a constraint...); 400
        naming what, and which sites of the model cannot, when none of them can: the gateway
        refuses only what the sites it would choose from cannot do."""
        sites = self.registry.all()
        needs = prepared.params.needs()
        if not needs:
            return sites
        able = [site for site in sites if needs <= site.client.capabilities]
        serving = [site for site in sites if site.model == prepared.model]
        if serving and not any(site.model == prepared.model for site in able):
            missing = sorted(needs - frozenset.intersection(
                *(site.client.capabilities for site in serving)))  # fmt: skip
            names = ", ".join(site.name for site in serving)
            raise invalid_request(
                f"no site serving model '{prepared.model}' ({names}) can do what this request "
                f"asks: {', '.join(missing)}",
                param=_CAPABILITY_PARAM.get(missing[0], missing[0]),
            )
        return able
