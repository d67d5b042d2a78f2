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
