"""The simulated offload coordinator keeps the real one's timing (fedsim/offload.py): the giver
releases what is queued when the ask reaches it, half its round trip after the plan; the released
requests are placed again half a round trip later; the next round starts an interval after the
last call answered."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedsim.events import EventLoop
from fedsim.offload import SimOffload
from gateway.sites.interface import LoadView, SiteInfoView


def _report(queued: int, running: int) -> LoadView:
    return LoadView(queued, running, 0, 0, 100 * (queued + running), 0, 64, 1000.0, 0, 0)


def _info(slots: int) -> SiteInfoView:
    return SiteInfoView("s", "m", 1024, 100, "t", "cpu", "float32", 16, 64, slots, "e", "1")


@dataclass
class FakeSite:
    """A site's view for the planner and its queue for the release."""

    name: str
    report: LoadView
    info: SiteInfoView
    queue: list[str] = field(default_factory=list)
    model: str = "m"
    healthy: bool = True
    can_release_queued: bool = True
    alive: bool = True
    asked_at: list[float] = field(default_factory=list)
    loop: EventLoop | None = None

    def release_queued(self, count: int) -> list[str]:
        assert self.loop is not None
        self.asked_at.append(self.loop.now())
        released, self.queue = self.queue[:count], self.queue[count:]
        return released


def _federation(loop: EventLoop) -> tuple[FakeSite, FakeSite]:
    giver = FakeSite("far", _report(3, 2), _info(2), ["q1", "q2", "q3"], loop=loop)
    taker = FakeSite("near", _report(0, 0), _info(8), loop=loop)
    return giver, taker


def test_release_half_a_round_trip_after_the_plan_and_placed_half_one_later() -> None:
    loop = EventLoop()
    giver, taker = _federation(loop)
    placed: list[tuple[float, str, str]] = []
    offload = SimOffload(
        loop,
        {"far": giver, "near": taker},
        {"far": giver, "near": taker},
        {"far": 0.1, "near": 0.01},
        lambda rid, site: placed.append((loop.now(), rid, site)),
        interval_s=0.5,
        transfer_cost_s=0.05,
    )
    offload.start(horizon_s=0.7)
    # Two of the three queued requests start at the site before the ask reaches it.
    loop.at(0.52, lambda: giver.queue.__delitem__(slice(0, 2)))
    loop.run(2.0)
    assert [round(t, 6) for t in giver.asked_at] == [0.55]
    assert [(round(t, 6), rid, site) for t, rid, site in placed] == [(0.6, "q3", "far")]
    assert offload.released == 1


def test_next_round_an_interval_after_the_last_answer() -> None:
    loop = EventLoop()
    giver, taker = _federation(loop)
    giver.queue = [f"q{i}" for i in range(10)]
    offload = SimOffload(
        loop,
        {"far": giver, "near": taker},
        {"far": giver, "near": taker},
        {"far": 0.1, "near": 0.01},
        lambda rid, site: None,
        interval_s=0.5,
        transfer_cost_s=0.05,
    )
    offload.start(horizon_s=1.5)
    loop.run(3.0)
    # Rounds at 0.5 and 1.1 (0.5 + the call's 0.1 s round trip + 0.5), not 1.0; 1.7 is past
    # the horizon.
    assert [round(t, 6) for t in giver.asked_at] == [0.55, 1.15]
