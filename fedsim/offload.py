"""The gateway's offload coordinator (gateway/admin/offload.py: OffloadCoordinator) on the virtual
clock, with the times its messages take.

The real coordinator sleeps GATEWAY_OFFLOAD_INTERVAL_S, plans from the sites' last load reports
(plan_offloads, the real planner) and then, plan by plan, awaits the giver's ReleaseQueued call:
the ask reaches the site half its round trip later, and the site hands back the requests that are
still queued *then* (not those queued when the plan was made: its batch slots may have taken
them meanwhile); each released request's stream ends "released", which reaches the gateway half a
round trip after that, and the request's dispatch places it again at once, never on the site
that released it (gateway/dispatch/stream.py). The call's answer comes a round trip after the
ask, and only then does the next plan's call go out; the next round starts an interval after
the last call answered. Before issue 78's placement check the twin released at the planning
instant, so it moved requests the real site had started by the time the ask arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Protocol

from fedsim.events import EventLoop
from gateway.admin.offload import OffloadPlan, OffloadSite, plan_offloads


class ReleasingSite(Protocol):
    """What the coordinator asks of a simulated site (fedsim/site.py: SimSite)."""

    @property
    def alive(self) -> bool: ...

    def release_queued(self, count: int) -> list[str]: ...


# Where a released request goes: (the site's request id, the giver's name) -> placed elsewhere.
Replace = Callable[[str, str], None]


class SimOffload:
    """Contract: every `interval_s` after the previous round's last release answered, plans with
    `plan_offloads` over `states`; each plan's giver releases up to its count half its round trip
    (`rtt_s`) after its call is sent, each released id goes to `replace` half a round trip after
    that, and the next plan's call is sent a round trip after the previous one. No round starts
    after `horizon_s`. `released` counts the requests handed back."""

    def __init__(
        self,
        loop: EventLoop,
        states: Mapping[str, OffloadSite],
        sites: Mapping[str, ReleasingSite],
        rtt_s: Mapping[str, float],
        replace: Replace,
        interval_s: float,
        transfer_cost_s: float,
    ) -> None:
        self._loop, self._states, self._sites, self._rtt = loop, states, sites, rtt_s
        self._replace = replace
        self._interval_s, self._transfer_cost_s = interval_s, transfer_cost_s
        self._horizon_s = 0.0
        self.released = 0

    def start(self, horizon_s: float) -> None:
        self._horizon_s = horizon_s
        self._next_round()

    def _next_round(self) -> None:
        at = self._loop.now() + self._interval_s
        if at <= self._horizon_s:
            self._loop.at(at, self._round)

    def _round(self) -> None:
        plans = plan_offloads(list(self._states.values()), self._transfer_cost_s)
        self._call(plans, 0)

    def _call(self, plans: Sequence[OffloadPlan], index: int) -> None:
        """Sends plan `index`'s ReleaseQueued now; the next goes when its answer comes."""
        if index >= len(plans):
            self._next_round()
            return
        plan = plans[index]
        rtt = self._rtt[plan.giver]
        self._loop.after(rtt / 2, lambda: self._release(plan, rtt))
        self._loop.after(rtt, lambda: self._call(plans, index + 1))

    def _release(self, plan: OffloadPlan, rtt_s: float) -> None:
        """The ask reached the giver: it hands back what is still queued there now."""
        giver = self._sites[plan.giver]
        if not giver.alive:
            return
        for request_id in giver.release_queued(plan.count):
            self.released += 1
            self._loop.after(rtt_s / 2, partial(self._replace, request_id, plan.giver))
