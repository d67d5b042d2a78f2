"""plan_offloads against its contract, table-driven."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from gateway.admin.offload import plan_offloads
from gateway.sites.interface import LoadView, SiteInfoView


def report(queued: int = 0, running: int = 0, remaining: int = 0, rate: float = 100.0) -> LoadView:
    return LoadView(queued, running, queued * 10, running * 10, remaining, 0, 100, rate, 0, 1)


def site_info(max_seqs: int = 4) -> SiteInfoView:
    return SiteInfoView("s", "m", 1024, 100, "f", "cpu", "float32", 16, 100, max_seqs, "e", "v")


FOUR_SLOTS = site_info(4)


@dataclass(frozen=True)
class Site:
    name: str
    report: LoadView | None
    info: SiteInfoView | None = FOUR_SLOTS
    healthy: bool = True
    model: str = "m"
    can_release_queued: bool = True


BUSY = Site("busy", report(queued=3, running=4, remaining=500))  # waits 5 s at 100 tok/s
IDLE = Site("idle", report(queued=0, running=1))  # 3 free slots


@pytest.mark.parametrize(
    ("sites", "cost_s", "expected"),
    [
        ([BUSY, IDLE], 0.05, [("busy", "idle", 3)]),
        ([BUSY, replace(IDLE, report=report(running=3))], 0.05, [("busy", "idle", 1)]),
        ([BUSY, IDLE], 10.0, []),  # moving costs more than the wait it saves
        ([BUSY, replace(IDLE, healthy=False)], 0.05, []),
        ([BUSY, replace(IDLE, model="other")], 0.05, []),
        ([BUSY, replace(IDLE, report=None)], 0.05, []),  # no report yet: not a taker
        # An OpenAI-compatible engine keeps its queue: never a giver, still a taker.
        ([replace(BUSY, can_release_queued=False), IDLE], 0.05, []),
        ([BUSY, replace(IDLE, can_release_queued=False)], 0.05, [("busy", "idle", 3)]),
        ([BUSY, replace(IDLE, report=report(queued=1))], 0.05, []),  # has a queue itself
        (
            [
                replace(BUSY, report=report(queued=5, running=4, remaining=500)),
                IDLE,
                Site("idle2", report(running=2)),
            ],
            0.05,
            [("busy", "idle", 3), ("busy", "idle2", 2)],
        ),
        (
            [
                Site("a", report(queued=1, remaining=50)),
                Site("b", report(queued=2, remaining=900)),
                Site("c", report(running=3)),
            ],
            0.05,
            [("b", "c", 1)],
        ),  # longest wait first
    ],
)
def test_plan_offloads(sites, cost_s, expected) -> None:
    plans = plan_offloads(sites, cost_s)
    assert [(p.giver, p.taker, p.count) for p in plans] == expected
