"""What the controller observes of a site (its work in seconds of its own time) and the scaling
file's checks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.federation import SiteConfig
from gateway.scaling.actuator import AskedStarts
from gateway.scaling.config import ScalingConfigError, parse_scaling
from gateway.scaling.observe import decode_tokens_per_s, observe, work_seconds
from gateway.scaling.policy import ScalingRule
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import LoadView, SiteInfoView
from gateway.sites.registry import SiteRegistry, SiteState

RULE = ScalingRule("m", site_tokens_per_s=500.0, site_prefill_tokens_per_s=4000.0)


@pytest.fixture(autouse=True)
def event_loop_for_channels() -> Iterator[None]:
    """A gRPC aio channel binds to the thread's event loop when made. The sites here are never
    called, only read, but a test must not depend on whether an earlier test in the same worker
    left a loop set (pytest-asyncio unsets it), so each gets its own."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def state(name: str, slots: int = 8) -> SiteState:
    config = SiteConfig(name, "aws", "r", "127.0.0.1:9", "m")
    info = SiteInfoView(name, "m", 1024, 100, "f", "cpu", "float32", 16, 64, slots, "e", "v")
    return SiteState(config, 1, GrpcSiteClient(name, config.endpoint, 1.0), True, info)


def report(queued_prompt: int, running: int, predicted: int, batch: int, rate: float) -> LoadView:
    return LoadView(1, batch, queued_prompt, running, predicted, 1, 64, rate, 1, 1)


def test_an_unmeasured_site_is_the_rule_s_prior() -> None:
    site = state("a")
    SiteRegistry([site])
    site.apply_report(report(800, 0, 1000, 0, 0.0))
    assert decode_tokens_per_s(site, 500.0) == 500.0
    assert work_seconds(site, RULE) == pytest.approx(800 / 4000 + 1000 / 500)


def test_a_measured_site_works_at_its_full_batch_rate() -> None:
    site = state("a", slots=8)
    SiteRegistry([site])
    # Steps of 0.01 s + 0.002 s per sequence: a full batch of 8 decodes 8 / 0.026 tokens/s.
    for batch in (1, 2, 4, 8, 2, 4):
        site.apply_report(report(0, 100, 0, batch, batch / (0.01 + 0.002 * batch)))
    assert decode_tokens_per_s(site, 500.0) == pytest.approx(8 / 0.026, rel=1e-6)
    site.apply_report(report(0, 100, 2600, 8, 8 / 0.026))
    assert work_seconds(site, RULE) == pytest.approx(2600 / (8 / 0.026), rel=1e-6)


def test_an_unmeasured_site_takes_its_peers_rate_and_the_ledger_counts_a_burst() -> None:
    measured, fresh = state("a"), state("b")
    SiteRegistry([measured, fresh])
    for batch in (2, 8):
        measured.apply_report(report(0, 0, 0, batch, batch / (0.01 + 0.002 * batch)))
    assert decode_tokens_per_s(fresh, 500.0) == pytest.approx(8 / 0.026, rel=1e-6)
    # Routed 3,000 tokens there since its last (empty) report: counted as answer to come.
    fresh.apply_report(report(0, 0, 0, 0, 0.0))
    fresh.ledger_tokens = 3000
    assert work_seconds(fresh, RULE) == pytest.approx(3000 / (8 / 0.026), rel=1e-6)


def test_observe_keeps_the_model_s_sites_and_what_may_go() -> None:
    a, b = state("a"), state("b")
    other = SiteState(SiteConfig("x", "aws", "r", "127.0.0.1:9", "other"), 3,
                      GrpcSiteClient("x", "127.0.0.1:9", 1.0))  # fmt: skip
    b.draining = True
    seen = observe(RULE, [a, b, other], lambda s: s.name == "b", pending=1)
    assert [(s.name, s.serving, s.removable) for s in seen.sites] == [
        ("a", True, False),
        ("b", False, True),
    ]
    assert seen.pending == 1


def test_arrivals_are_the_model_s_shared_by_its_sites_and_outlive_a_leaving_one() -> None:
    a, b = state("a"), state("b")
    other = SiteState(SiteConfig("x", "aws", "r", "127.0.0.1:9", "other"), 3,
                      GrpcSiteClient("x", "127.0.0.1:9", 1.0))  # fmt: skip
    registry = SiteRegistry([a, b, other])
    a.arrivals.add(100, 40)
    b.arrivals.add(10, 4)
    other.arrivals.add(7, 7)
    assert registry.arrivals("m") is a.arrivals is b.arrivals
    assert (a.arrivals.requests, a.arrivals.prompt_tokens, a.arrivals.answer_tokens) == (2, 110, 44)
    assert registry.arrivals("other").prompt_tokens == 7
    registry.remove("b")
    assert registry.arrivals("m").answer_tokens == 44  # the count goes on without it
    assert registry.arrivals("unseen").requests == 0


def test_observe_carries_the_arrivals_the_start_time_and_the_median_rates() -> None:
    fast, slow, down = state("a"), state("b"), state("c")
    registry = SiteRegistry([fast, slow, down])
    for batch in (2, 8):
        fast.apply_report(report(0, 0, 0, batch, batch / (0.01 + 0.001 * batch)))
    down.healthy = False  # not serving: its rates are not the model's
    registry.arrivals("m").add(500, 300)
    seen = observe(RULE, registry.all(), lambda s: False, 0, registry.arrivals("m"), 17.5)
    assert (seen.arrived_prompt_tokens, seen.arrived_answer_tokens) == (500, 300)
    assert seen.start_s == 17.5
    # The unmeasured one takes its measured peer's rate: both decode at the measured one's.
    assert seen.decode_tokens_per_s == pytest.approx(8 / 0.018, rel=1e-6)
    assert seen.prefill_tokens_per_s == RULE.site_prefill_tokens_per_s
    nobody = observe(RULE, [down], lambda s: False, 0)
    assert nobody.decode_tokens_per_s is None
    assert nobody.arrived_answer_tokens == 0


def test_asked_starts_measure_how_long_a_start_took() -> None:
    now = [100.0]
    asked = AskedStarts(60.0, clock=lambda: now[0])
    assert asked.last_start_s is None
    asked.ask(2)
    now[0] = 125.0
    asked.arrived()
    assert asked.last_start_s == pytest.approx(25.0)
    assert len(asked) == 1


def scaling(**model: object) -> bytes:
    entry = {"model": "m", "actuator": {"kind": "signal"}, **model}
    return json.dumps({"models": [entry]}).encode()


def test_a_good_file_parses() -> None:
    config = parse_scaling(
        scaling(min_sites=2, max_sites=5, actuator={
            "kind": "local", "command": ["python", "-m", "site_engine"],
            "slots": [{"env": {"CUDA_VISIBLE_DEVICES": "1"}, "args": ["--device", "cuda"]}],
            "log_dir": "logs"}),
        Path("/etc/fedllm"),
        frozenset({"m"}),
    )  # fmt: skip
    (model,) = config.models
    assert (model.rule.min_sites, model.rule.max_sites) == (2, 5)
    assert (model.rule.rate_s, model.rule.in_window_s, model.rule.in_headroom) == (5.0, 60.0, 0.2)
    assert model.actuator.name_prefix == "m-elastic"
    assert model.actuator.log_dir == Path("/etc/fedllm/logs")
    assert model.actuator.slots[0].env == (("CUDA_VISIBLE_DEVICES", "1"),)
    assert config.rules["m"] is model.rule


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (scaling(model="nope"), "not a model of the federation file"),
        (scaling(min_sites=3, max_sites=2), "min_sites"),
        (scaling(actuator={"kind": "local"}), "needs 'command' and 'slots'"),
        (scaling(actuator={"kind": "kubernetes", "host_pattern": "pod.svc"}), "host_pattern"),
        (scaling(actuator={"kind": "ssh"}), "invalid scaling file"),
        (scaling(actuator={"kind": "signal", "pool_size": 1}), "signal actuator has no pool"),
        (scaling(actuator={"kind": "signal", "pool_size": 65}), "invalid scaling file"),
        (scaling(target_backlog_s=0), "invalid scaling file"),
        (scaling(in_headroom=1.0), "invalid scaling file"),
        (scaling(in_window_s=0), "invalid scaling file"),
        (scaling(trend_s=10), "invalid scaling file"),
        (scaling(surprise=1), "invalid scaling file"),
        (json.dumps({"models": [json.loads(scaling())["models"][0]] * 2}).encode(), "twice"),
    ],
)
def test_bad_files_are_refused_with_a_reason(data: bytes, says: str) -> None:
    with pytest.raises(ScalingConfigError, match=says):
        parse_scaling(data, Path("."), frozenset({"m"}))
