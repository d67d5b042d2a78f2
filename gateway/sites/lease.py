"""A request's place in a site's counters: the one way the gateway's per-site `in_flight` and
`ledger_tokens` (gateway/sites/registry.py) change.

Routing reads both counters to place the next request, so a request is counted on its site from
the moment it is placed, before anything is awaited: the decisions for the rest of a burst must
already see it. A dispatch (gateway/dispatch/stream.py) holds one lease for its whole life and
moves it from site to site as the request moves (released by the site before it started, failed,
or continued elsewhere mid-answer); releasing gives back exactly what the lease holds, and
releasing twice gives back nothing more, so a finalizer may release what the normal path
already has.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.sites.registry import SiteState


@dataclass(slots=True)
class SiteLease:
    """One request counted on one site at a time: one request in `in_flight`, and `tokens` (its
    prompt plus the answer tokens planned and not streamed yet) in `ledger_tokens`."""

    site: SiteState
    tokens: int = 0
    held: bool = False

    @classmethod
    def take(cls, site: SiteState, tokens: int) -> SiteLease:
        """A lease held on `site` for `tokens`, counted there at once."""
        lease = cls(site)
        lease.move(site, tokens)
        return lease

    def move(self, site: SiteState, tokens: int) -> None:
        """Counts the request on `site` for `tokens` instead of where it was (if anywhere), in
        one step: no decision can see it on neither or on both. Onto the site it holds, only
        its tokens change: the request neither left that site nor came to it again (the
        turnover that routing subtracts from a site's placements, SiteState.unreported)."""
        if self.held and self.site is site:
            self.recharge(tokens)
            return
        self.release()
        site.in_flight += 1
        site.placed += 1
        site.ledger_tokens += tokens
        self.site, self.tokens, self.held = site, tokens, True

    def recharge(self, tokens: int) -> None:
        """The request's token load on its site is now `tokens` (its answer streams back, or
        its plan changed); nothing when the lease is not held."""
        if self.held:
            self.site.ledger_tokens += tokens - self.tokens
            self.tokens = tokens

    def release(self) -> None:
        """Gives back what the lease holds on its site; nothing when it holds nothing."""
        if self.held:
            self.held = False
            self.site.in_flight -= 1
            self.site.left += 1
            self.site.ledger_tokens -= self.tokens
