"""The simulator runs the real engine core and the real routing, and a seed decides a run."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from fedsim.calibrate.fit import Observation, fit
from fedsim.cards import CARDS, MODELS
from fedsim.events import EventLoop
from fedsim.federation import Failure, RunResult, run
from fedsim.gateway import GatewaySettings
from fedsim.site import EOS, TOKEN, SimSite, SiteSpec
from fedsim.step_time import StepFeatures, StepTimeModel
from fedsim.study import goodput
from fedsim.workload import SimRequest, WorkloadSpec, build
from site_engine.engine.core.scheduler import Scheduler
from site_engine.engine.core.sequence import SequenceUpdate
from site_engine.engine.core.types import ModelRunnerOutput, SamplingParams, SchedulerOutput

STEP = StepTimeModel("h100", 0.004, 2e-5, 3e-5, 1e-8, 0.0, 0.002)
# Small engines, so that a few dozen requests queue, preempt and share prefixes.
SEQS = 4


def _spec(name: str = "s0", rtt_s: float = 0.02, card: str = "h100") -> SiteSpec:
    step = STEP.on(CARDS["h100"], CARDS[card])
    return SiteSpec(
        name,
        CARDS[card],
        MODELS["llama8b"],
        step,
        rtt_s,
        max_num_seqs=SEQS,
        max_num_batched_tokens=64,
        block_size=16,
        max_model_len=512,
    )


def _requests() -> list[tuple[str, tuple[int, ...], int]]:
    shared = tuple(range(10, 42))  # two full blocks every third prompt shares
    out = []
    for i in range(12):
        head = shared if i % 3 == 0 else tuple(range(1000 + 100 * i, 1032 + 100 * i))
        out.append((f"r{i}", (*head, *range(5000 + i * 50, 5000 + i * 50 + 7 + i)), 3 + i % 5))
    return out


def _simulated_site(async_scheduling: bool = True) -> SimSite:
    loop = EventLoop()
    spec = dataclasses.replace(_spec(), async_scheduling=async_scheduling)
    site = SimSite(spec, loop, lambda s, u: None)
    site.trace = []
    for rid, prompt, answer in _requests():
        site.add(rid, prompt, answer, 64, answer)
    loop.run(1e6)
    assert not site.scheduler.has_unfinished()
    return site


def _simulated_schedule(async_scheduling: bool = True) -> list[tuple[tuple[str, int], ...]]:
    trace = _simulated_site(async_scheduling).trace
    assert trace is not None
    return trace


def _reference_schedule(async_scheduling: bool) -> list[tuple[tuple[str, int], ...]]:
    """The same requests through a bare Scheduler: no event loop, no fitted time. Async: in
    PagedEngine's pipelined order (each step planned before its predecessor is updated; an
    empty one updated at once, the next planned after); else schedule -> update -> schedule."""
    scheduler = Scheduler(SimSite(_spec(), EventLoop(), lambda s, u: None).scheduler.config)
    answers = {rid: answer for rid, _, answer in _requests()}
    trace = []
    pending = list(_requests())
    first = pending.pop(0)
    scheduler.add(
        first[0],
        first[1],
        SamplingParams(max_tokens=64, temperature=0.0),
        predicted_tokens=first[2],
    )
    output = scheduler.schedule()
    planned = scheduler.schedule() if async_scheduling else None
    for rid, prompt, answer in pending:  # arrive while the first step runs
        scheduler.add(
            rid, prompt, SamplingParams(max_tokens=64, temperature=0.0), predicted_tokens=answer
        )
    while True:
        trace.append(tuple((c.request_id, len(c.token_ids)) for c in output.chunks))
        sampled = {
            c.request_id: EOS if c.num_generated + 1 >= answers[c.request_id] else TOKEN
            for c in output.chunks
            if c.sample and scheduler.get(c.request_id) is not None
        }
        scheduler.update(output, ModelRunnerOutput(sampled))
        if planned is not None and planned.is_empty:
            scheduler.update(planned, ModelRunnerOutput({}))
            planned = None
        if planned is None:
            if not scheduler.has_unfinished():
                return trace
            planned = scheduler.schedule()
        output = planned
        planned = scheduler.schedule() if async_scheduling else None


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_simulated_site_steps_exactly_as_the_real_scheduler_decides(
    async_scheduling: bool,
) -> None:
    simulated = _simulated_schedule(async_scheduling)
    assert simulated == _reference_schedule(async_scheduling)
    # The case exercises what matters: chunked prefill and a full batch.
    assert any(n > 1 for step in simulated for _, n in step)
    assert max(len(step) for step in simulated) == SEQS


def test_async_scheduling_pipelines_the_schedule() -> None:
    pipelined, synchronous = _simulated_schedule(True), _simulated_schedule(False)
    assert pipelined != synchronous
    # A sequence that finishes on EOS has one more row computed (its token thrown away), and a
    # request arriving while the first step runs misses the second, planned with it.
    assert sum(map(len, pipelined)) > sum(map(len, synchronous))
    assert [rid for rid, _ in pipelined[1]] == ["r0"]
    assert "r1" in {rid for rid, _ in synchronous[1]}
    # The thrown-away rows get no token: the decode rate counts the answers' tokens only.
    decoded = sum(answer - 1 for _, _, answer in _requests())
    for async_scheduling in (True, False):
        site = _simulated_site(async_scheduling)
        assert sum(step.decoded for step in site.rates.steps) == decoded


def _first_token_steps(async_scheduling: bool) -> tuple[int, float]:
    """A request that arrives while another's decode step runs: (steps from its arrival to its
    first token, counting the one running then; seconds)."""
    loop = EventLoop()
    spec = dataclasses.replace(_spec(), async_scheduling=async_scheduling)
    first: list[tuple[int, float]] = []
    arrived: list[tuple[int, float]] = []

    def arrive() -> None:
        arrived.append((site.steps, loop.now()))
        site.add("late", tuple(range(300, 310)), 5, 16, 5)

    def on_updates(site: SimSite, updates: Sequence[SequenceUpdate]) -> None:
        if site.steps == 10:  # the long request decodes alone: half its next step later
            loop.after(STEP.seconds(StepFeatures(0, 1, 16 + 10, 0, 0)) / 2, arrive)
        if not first and any(u.request_id == "late" and u.new_token_ids for u in updates):
            first.append((site.steps, loop.now()))

    site = SimSite(spec, loop, on_updates)
    site.add("long", tuple(range(100, 116)), 200, 256, 200)
    loop.run(1e6)
    (steps_before, arrival), (steps_after, token_at) = arrived[0], first[0]
    return steps_after - steps_before, token_at - arrival


def test_an_arrival_mid_step_gets_its_first_token_one_step_later_with_async_scheduling() -> None:
    async_steps, async_s = _first_token_steps(True)
    sync_steps, sync_s = _first_token_steps(False)
    # Synchronously: the rest of the running step, then its own. Async: the step planned when
    # the running one started comes between.
    assert (sync_steps, async_steps) == (2, 3)
    one_decode = STEP.seconds(StepFeatures(0, 1, 16 + 20, 0, 0))
    assert async_s - sync_s == pytest.approx(one_decode, rel=0.01)


def test_the_schedule_is_the_scheduler_s_own(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _simulated_schedule()
    # Admission order is the scheduler's policy: shortest prompt first changes what runs when.
    spec = dataclasses.replace(_spec(), policy="spf")
    loop = EventLoop()
    site = SimSite(spec, loop, lambda s, u: None)
    site.trace = []
    for rid, prompt, answer in _requests():
        site.add(rid, prompt, answer, 64, answer)
    loop.run(1e6)
    assert site.trace != before
    calls: list[int] = []
    original = Scheduler.schedule

    def counted(self: Scheduler) -> SchedulerOutput:
        calls.append(1)
        return original(self)

    monkeypatch.setattr(Scheduler, "schedule", counted)
    assert _simulated_schedule() == before
    assert len(calls) >= len(before)


def _federation(
    seed: int, policy: str = "least_requests", failures: tuple[Failure, ...] = ()
) -> RunResult:
    specs = [_spec("a", 0.005), _spec("b", 0.08, "l40s"), _spec("c", 0.03, "h200")]
    requests = build(WorkloadSpec(rate=6.0, duration_s=4.0, seed=seed, max_model_len=512))
    requests = [
        dataclasses.replace(
            r, prompt=r.prompt[:200], answer_tokens=min(r.answer_tokens, 40), max_tokens=64
        )
        for r in requests
    ]
    return run(specs, requests, GatewaySettings(policy=policy), failures, drain_s=120.0)


def test_a_seed_gives_identical_results_twice() -> None:
    first, second = _federation(1), _federation(1)
    assert first == second
    assert first != _federation(2)


@pytest.mark.parametrize("policy", ["round_robin", "mico", "completion_cost", "least_latency"])
def test_every_request_survives_a_site_failure(policy: str) -> None:
    result = _federation(3, policy, (Failure("a", 1.5),))
    assert result.completed == result.requests
    assert result.failovers > 0


def test_the_fit_recovers_a_known_step_model_and_cards_scale_by_the_roofline() -> None:
    truth = StepTimeModel("h100", 0.002, 3e-6, 1e-5, 2e-8, 5e-10, 0.004, 0.0005, 0.0002)
    shapes = [
        StepFeatures(p, d, d * c + p, p * p, a)
        for p in (0, 16, 512, 2048)
        for d in (0, 8, 128)
        for c in (128, 2048)
        for a in (0, 1, 8)
        if p or d
    ]
    rows = [Observation("h100", "m", f, truth.seconds(f), str(f)) for f in shapes]
    fitted = fit(rows, "h100")
    for f in shapes:
        assert fitted.seconds(f) == pytest.approx(truth.seconds(f), rel=1e-6)
    slow = truth.on(CARDS["h100"], CARDS["l40s"])
    decode = StepFeatures(0, 1, 100, 0, 0)
    assert slow.seconds(decode) > 3 * truth.seconds(decode)


def test_a_request_the_engine_refuses_is_refused_by_the_simulated_site_too() -> None:
    site = SimSite(_spec(), EventLoop(), lambda s, u: None)
    with pytest.raises(ValueError, match="max_model_len"):
        site.add("big", tuple(range(1, 500)), 10, 100, 10)
    assert not site.scheduler.has_unfinished()


def test_sim_requests_are_plain_values() -> None:
    r = SimRequest("x", 0.0, (1, 2), 3, 4)
    assert dataclasses.replace(r, arrival_s=1.0).arrival_s == 1.0


def test_goodput_brackets_then_bisects_the_highest_rate_that_meets_the_slo() -> None:
    asked: list[float] = []

    def meets(rate: float) -> bool:
        asked.append(rate)
        return rate <= 7.3

    found = goodput(meets, guess=2.0, steps=6)
    assert 7.3 - 8.0 / 2**6 <= found <= 7.3
    assert asked[:3] == [2.0, 4.0, 8.0]  # doubled until it failed
    assert goodput(lambda rate: False, guess=2.0, steps=3) == 0.0


def test_a_site_takes_the_engine_s_adapter_overtaking_unless_it_names_one() -> None:
    spec = dataclasses.replace(_spec(), max_loras=2)
    engine_default = SimSite(spec, EventLoop(), lambda s, u: None).scheduler.config
    named = dataclasses.replace(
        spec, adapter_overtake_steps=engine_default.adapter_overtake_steps + 7
    )
    config = SimSite(named, EventLoop(), lambda s, u: None).scheduler.config
    assert config.adapter_overtake_steps == engine_default.adapter_overtake_steps + 7
    assert dataclasses.replace(config, adapter_overtake_steps=0) == dataclasses.replace(
        engine_default, adapter_overtake_steps=0
    )


def test_goodput_brackets_down_from_a_guess_above_the_answer_by_the_growth_factor() -> None:
    asked: list[float] = []

    def meets(rate: float) -> bool:
        asked.append(rate)
        return rate <= 7.3

    found = goodput(meets, guess=10.0, steps=5, grow=1.25)
    assert asked[:3] == [10.0, 8.0, 6.4]  # down by 1.25 until it held
    assert 7.3 - 1.6 / 2**5 <= found <= 7.3
    with pytest.raises(ValueError, match="grow must exceed 1"):
        goodput(meets, guess=10.0, steps=1, grow=1.0)
