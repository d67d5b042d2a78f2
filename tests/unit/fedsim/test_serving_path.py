"""The serving path's CPU in the simulator (fedsim/serving_path.py): the gateway's loop as a CPU
whose work queues, the chunk pacing, and a federation run with them."""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest

from fedsim.events import EventLoop
from fedsim.federation import RunResult, run
from fedsim.gateway import GatewaySettings
from fedsim.serving_path import CpuServer, ServingCosts, ServingPath
from fedsim.workload import SimRequest
from tests.unit.fedsim.test_fedsim import _spec


def _mean_wait(utilisation: float, work_s: float = 1e-3, jobs: int = 4000) -> float:
    """Mean seconds from submitting to done, beyond the work itself, under Poisson arrivals."""
    server, rng, now, waited = CpuServer(), random.Random(7), 0.0, 0.0
    for _ in range(jobs):
        now += rng.expovariate(utilisation / work_s)
        waited += server.submit(now, work_s) - now - work_s
    return waited / jobs


def test_the_loop_s_delay_is_the_work_alone_when_idle_and_grows_as_it_nears_one_core() -> None:
    server = CpuServer()
    assert server.submit(1.0, 0.002) == pytest.approx(1.002)  # idle: the work itself
    assert server.submit(1.0, 0.002) == pytest.approx(1.004)  # behind the first
    assert server.submit(5.0, 0.001) == pytest.approx(5.001)  # idle again
    assert server.busy_s == pytest.approx(0.005)
    waits = [_mean_wait(u) for u in (0.05, 0.5, 0.8, 0.95)]
    assert waits[0] < 0.1e-3  # ~0 beside the 1 ms of work
    assert waits == sorted(waits)
    assert waits[-1] > 10 * waits[1]  # M/D/1: rho / (2 (1 - rho)) of the work
    assert waits[1] == pytest.approx(0.5e-3, rel=0.25)


def _path(costs: ServingCosts) -> tuple[EventLoop, ServingPath, list[tuple[float, int, bool]]]:
    loop = EventLoop()
    got: list[tuple[float, int, bool]] = []
    path = ServingPath(loop, costs, lambda _, tokens, last: got.append((loop.now(), tokens, last)))
    return loop, path, got


def test_chunks_are_paced_by_the_streams_open_first_token_and_finish_at_once() -> None:
    costs = ServingCosts(request_s=0.0, chunk_s=0.0, token_s=0.0, chunks_per_s=20.0)
    loop, path, got = _path(costs)
    path.opened("a")
    path.opened("b")  # two streams: a chunk at most every 0.1 s each
    for at in (0.0, 0.03, 0.06, 0.09, 0.12, 0.15, 0.18):  # a token every 30 ms
        loop.at(at, lambda: path.arrived("a", 1, False))
    loop.at(0.19, lambda: path.arrived("a", 1, True))
    loop.run(1.0)
    # The first at once; the next three held until 0.1 s after it; the finish at once, with
    # what was held since.
    assert [(round(t, 3), tokens, last) for t, tokens, last in got] == [
        (0.0, 1, False),
        (0.1, 3, False),
        (0.19, 4, True),
    ]
    assert path.chunks == 3
    assert path.tokens == 8
    path.opened("c")
    assert path.interval_s() == pytest.approx(3 / 20.0)


def test_a_chunk_reaches_the_client_when_the_loop_has_streamed_it() -> None:
    costs = ServingCosts(request_s=0.001, chunk_s=0.0005, token_s=0.0001, chunks_per_s=0.0)
    loop, path, got = _path(costs)
    admitted: list[float] = []
    path.admit(lambda: admitted.append(loop.now()))
    path.opened("a")
    path.arrived("a", 5, False)  # behind the request's work: 1 ms + 0.5 ms + 5 x 0.1 ms
    loop.run(1.0)
    assert admitted == [pytest.approx(0.001)]
    assert [(round(t, 6), tokens, last) for t, tokens, last in got] == [(0.002, 5, False)]
    assert path.gateway.busy_s == pytest.approx(0.002)
    assert path.site_delay("s", 100) == pytest.approx(100 * costs.site_token_s)


def _requests(rate: float, count: int = 60) -> list[SimRequest]:
    rng = random.Random(3)
    out, at = [], 0.0
    for i in range(count):
        at += rng.expovariate(rate)
        prompt = tuple(range(1000 + 50 * i, 1020 + 50 * i))
        out.append(SimRequest(f"r{i}", at, prompt, 8, 8))
    return out


def _run(costs: ServingCosts | None, rate: float = 20.0) -> RunResult:
    specs = [_spec("a", 0.01), _spec("b", 0.02)]
    settings = GatewaySettings(policy="least_requests", serving=costs)
    return run(specs, _requests(rate), settings, drain_s=60.0)


def test_a_federation_with_the_serving_path_pays_its_cpu_and_a_busy_loop_delays_first_tokens() -> (
    None
):
    free = _run(None)
    idle = _run(ServingCosts())
    assert idle.completed == free.completed == 60
    assert [o.produced for o in idle.outcomes] == [o.produced for o in free.outcomes]
    # Idle: a first token later by about its request's and its chunk's work, no more.
    assert idle.ttft_p50 == pytest.approx(free.ttft_p50 + 1.05e-3, abs=0.5e-3)
    assert idle.gateway_cpu_s == pytest.approx(60 * 1e-3 + idle.gateway_chunks * 50e-6, rel=0.01)
    assert free.gateway_cpu_s == 0.0
    # The same requests on a loop whose request work is 0.95 of a core at this rate.
    busy = _run(dataclasses.replace(ServingCosts(), request_s=0.95 / 20.0))
    assert busy.completed == 60
    assert busy.ttft_p50 > free.ttft_p50 + 0.1
    assert all(o.first_site in ("a", "b") for o in busy.outcomes)


def test_tokens_that_come_while_their_chunk_waits_for_the_loop_join_it() -> None:
    costs = ServingCosts(request_s=0.05, chunk_s=0.001, token_s=0.0, chunks_per_s=0.0)
    loop, path, got = _path(costs)
    path.admit(lambda: None)  # 50 ms of other work first: the loop lags
    path.opened("a")
    for at in (0.0, 0.01, 0.02):
        loop.at(at, lambda: path.arrived("a", 1, False))
    loop.at(0.03, lambda: path.arrived("a", 1, True))
    loop.run(1.0)
    # One chunk: all four tokens and the finish came before the loop got to the answer.
    assert [(round(t, 6), tokens, last) for t, tokens, last in got] == [(0.051, 4, True)]
    assert path.chunks == 1


def test_a_loop_that_stays_busy_streams_at_the_budget_s_floor_and_comes_back_when_it_frees() -> (
    None
):
    """The chunk governor as the real gateway runs it (gateway/sites/chunk_governor.py): each
    check wakes after the loop's queued work, and a late one cuts the budget."""
    costs = ServingCosts(request_s=0.012, chunk_s=0.0, token_s=0.0, chunks_per_s=8000.0,
                         chunks_min_per_s=1000.0)  # fmt: skip
    loop, path, _ = _path(costs)
    path.start(horizon_s=10.0)
    path.opened("a")  # one stream: the interval is 1 / the budget now
    for i in range(200):  # 1.2 cores of request work for 2 s
        loop.at(i * 0.01, lambda: path.admit(lambda: None))
    seen: dict[float, float] = {}

    def look(at: float) -> None:
        seen[at] = path.interval_s()

    for at in (0.02, 2.0, 6.0):
        loop.at(at, functools.partial(look, at))
    loop.run(7.0)
    assert seen[0.02] == pytest.approx(1 / 8000)  # no check yet
    assert seen[2.0] == pytest.approx(1 / 1000)  # cut to the floor while it lagged
    assert seen[6.0] == pytest.approx(1 / 8000)  # grown back once it was idle


def test_a_fixed_budget_or_an_unstarted_path_has_no_governor() -> None:
    assert ServingCosts(chunks_per_s=8000.0, chunks_min_per_s=8000.0).governor() is None
    assert ServingCosts(chunks_per_s=8000.0).governor() is None  # the default: off
    assert ServingCosts(chunks_per_s=0.0).governor() is None
    governed = ServingCosts(chunks_per_s=8000.0, chunks_min_per_s=2000.0).governor()
    assert governed is not None
    assert governed.floor == 0.25
