"""The step time routing assumes for a site that has not reported decoding yet: the median of
the measured sites serving the same model, else the routing prior. A fixed prior made a site
that had just served a conversation (and so was measured) lose its next turn to an unmeasured
site whenever the prior was faster than the measurement."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from gateway.federation import SiteConfig
from gateway.routing.types import StepTime
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView
from gateway.sites.registry import SiteRegistry, SiteState, median_step


def site(name: str, model: str = "tiny") -> SiteState:
    # Real clients (they need a running loop), never called.
    return SiteState(
        config=SiteConfig(name, "aws", "us-east-1", "127.0.0.1:1", model),
        site_id=0,
        client=GrpcSiteClient(name, "127.0.0.1:1", 1.0),
    )


def report(running: int, decode_tokens_per_s: float, prefill: float = 0.0) -> LoadView:
    return LoadView(0, running, 0, 0, 0, 1, 10, decode_tokens_per_s, 1, 1,
                    prefill_tokens_per_s=prefill)  # fmt: skip


def test_median_step_takes_the_middle_measurement() -> None:
    assert median_step([]) is None
    assert median_step([None, None]) is None
    assert median_step([StepTime(0.03), None, StepTime(0.01), StepTime(0.02)]) == StepTime(0.02)
    assert median_step([StepTime(0.03), StepTime(0.01)]) == StepTime(0.01)


def sites(*names: str) -> list[SiteState]:
    async def build() -> list[SiteState]:
        return [site(name, model="big" if name == "big" else "tiny") for name in names]

    return asyncio.run(build())


def test_an_unmeasured_site_steps_as_its_measured_peers() -> None:
    a, b, c, other_model = sites("a", "b", "c", "big")
    SiteRegistry([a, b, c, other_model])
    assert a.latency.step is None  # nobody measured: the routing prior applies
    a.apply_report(report(1, 20.0))  # one sequence at 20 tokens/s: 50 ms a step
    b.apply_report(report(2, 20.0))  # two at 20 tokens/s: 100 ms
    assert a.latency.step == StepTime(0.05)
    assert c.latency.step == StepTime(0.05)  # the lower middle of 50 and 100 ms
    assert other_model.latency.step is None  # another model's speed says nothing of this one


def test_a_measured_site_keeps_its_own_step() -> None:
    a, b = sites("a", "b")
    SiteRegistry([a, b])
    b.apply_report(report(1, 100.0))
    a.apply_report(report(1, 10.0))
    assert a.latency.step == StepTime(0.1)
    assert b.latency.step == StepTime(0.01)


def test_the_prefill_rate_is_the_operators_else_measured_else_the_peers() -> None:
    a, b, c, configured = sites("a", "b", "c", "configured")
    configured.config = replace(configured.config, prefill_tokens_per_s=500.0)
    SiteRegistry([a, b, c, configured])
    assert a.prefill_tokens_per_s is None  # nobody measured: the routing profile's figure
    a.apply_report(report(0, 0.0, prefill=4000.0))
    a.apply_report(report(0, 0.0, prefill=0.0))  # an idle window says nothing
    b.apply_report(report(0, 0.0, prefill=2000.0))
    assert a.prefill_tokens_per_s == 4000.0
    assert b.prefill_tokens_per_s == 2000.0
    assert c.prefill_tokens_per_s == 2000.0  # the lower middle of the measured peers'
    configured.apply_report(report(0, 0.0, prefill=9000.0))
    assert configured.prefill_tokens_per_s == 500.0  # the federation file has the last word


def test_the_peers_median_is_taken_again_whenever_a_peer_learns_or_the_peers_change() -> None:
    """The median is kept between decisions (routing reads it for every site at every one); it
    must still follow every new report of a peer, and sites joining or leaving."""
    a, b, c, d = sites("a", "b", "c", "d")
    registry = SiteRegistry([a, b, c])
    a.apply_report(report(1, 20.0, prefill=1000.0))  # 50 ms a step
    assert (c.latency.step, c.prefill_tokens_per_s) == (StepTime(0.05), 1000.0)
    b.apply_report(report(1, 100.0, prefill=500.0))  # 10 ms: the lower middle now
    assert (c.latency.step, c.prefill_tokens_per_s) == (StepTime(0.01), 500.0)
    b.apply_report(report(0, 0.0))  # an idle report teaches nothing: the same medians
    assert (c.latency.step, c.prefill_tokens_per_s) == (StepTime(0.01), 500.0)
    registry.remove("b")
    assert (c.latency.step, c.prefill_tokens_per_s) == (StepTime(0.05), 1000.0)
    d.apply_report(report(1, 200.0, prefill=250.0))  # 5 ms, measured before it joins
    registry.add(d)
    assert (c.latency.step, c.prefill_tokens_per_s) == (StepTime(0.005), 250.0)
    assert b.latency.step == StepTime(0.01)  # the one that left keeps its own


def test_a_sites_latency_signals_follow_its_reports_requests_and_round_trips() -> None:
    (a,) = sites("a")
    first = a.latency
    assert a.latency is first  # nothing changed: the same signals, not built again
    a.in_flight += 3
    assert a.latency.requests == 3
    a.apply_report(replace(report(1, 20.0), queued_requests=5, predicted_remaining_tokens=70))
    assert (a.latency.requests, a.latency.remaining_answer_tokens) == (6, 70)
    assert a.latency.step == StepTime(0.05)
    a.rtt.observe(0.2)
    a.rtt.observe(0.1)
    assert a.latency.rtt_s == 0.1
    a.in_flight -= 3
    assert a.latency.requests == 6
