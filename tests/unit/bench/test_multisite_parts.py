"""Parts of the multi-site benchmark that need no site: holds per policy, the throttle on a real
process, and the routing decision timing."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from bench.multisite.cluster import SiteSpec, federation_document, site_specs
from bench.multisite.decision import time_decisions
from bench.multisite.hold import holds_needed
from bench.multisite.throttle import Throttle
from gateway.routing.policy import POLICY_NAMES


@pytest.mark.parametrize(("policy", "holds"), [("static", 1), ("fcfs", 6), ("spf", 6)])
def test_a_static_site_needs_one_hold_an_iteration_level_site_one_per_slot(
    policy: str, holds: int
) -> None:
    assert holds_needed(SiteSpec("s", "m", policy, 6, 1)) == holds


def test_the_federation_names_every_site_with_its_weight_and_one_entry_per_model() -> None:
    specs = [*site_specs("a", "fcfs", 2, 4), SiteSpec("big", "b", "fcfs", 8, 9, 2.0)]
    document = federation_document(Path("/models/tiny"), specs)
    assert document["models"] == [
        {"name": "a", "tokenizer": "/models/tiny"},
        {"name": "b", "tokenizer": "/models/tiny"},
    ]
    sites = document["sites"]
    assert isinstance(sites, list)
    assert [(s["name"], s["model"], s["capacity_weight"]) for s in sites] == [
        ("a-1", "a", 1.0),
        ("a-2", "a", 1.0),
        ("big", "b", 2.0),
    ]
    assert len({s["endpoint"] for s in sites}) == 3


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


def test_the_throttle_stops_and_resumes_a_process_and_leaves_it_running() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        throttle = Throttle((child.pid,), stopped_share=0.9, period_s=0.05)
        throttle.start()
        seen: set[str] = set()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and seen != {"T", "S"}:
            seen.add(_state(child.pid))
            time.sleep(0.003)
        throttle.stop()
        assert "T" in seen  # stopped most of the time ...
        assert _state(child.pid) != "T"  # ... and running again afterwards
    finally:
        child.kill()
        child.wait()


def test_the_throttle_rejects_shares_outside_zero_one() -> None:
    with pytest.raises(ValueError, match="stopped_share"):
        Throttle((1,), stopped_share=1.0)


def test_decision_times_cover_every_policy_at_nine_sites() -> None:
    times = time_decisions(sites=9, decisions=300)
    assert sorted(t.policy for t in times) == sorted(POLICY_NAMES)
    for t in times:
        assert (t.sites, t.decisions) == (9, 300)
        assert 0 < t.p50_ms <= t.p99_ms <= t.max_ms
