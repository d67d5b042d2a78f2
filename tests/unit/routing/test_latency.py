"""Table-driven tests of latency-aware routing: the round-trip and step-time estimators, the
latency model, the completion-time cost, the ledger-only token cost and the prompt-ratio answer
guess."""

from __future__ import annotations

import math

import pytest

from gateway.routing.costs import LedgerTokensCost
from gateway.routing.latency import (
    LatencyModel,
    PredictedCompletionCost,
    RttEstimator,
    StepTimeModel,
)
from gateway.routing.policy import build_policy
from gateway.routing.types import RoutingRequest, SiteLatency, StepTime, planned_answer_tokens
from tests.unit.routing.sites import Site, lowest, request

STEP = StepTime(0.01)  # 10 ms a step whatever the batch
MODEL = LatencyModel(prior_step=StepTime(0.02), prefill_chunk_tokens=100)


@pytest.mark.parametrize(
    ("samples", "window", "value"),
    [
        ([], 8, None),
        ([0.08], 8, 0.08),
        ([0.08, 0.05, 0.3], 8, 0.05),  # a slow answer is the site's queueing, not the network
        ([0.01, 0.2, 0.3, 0.4], 3, 0.2),  # the old minimum has left the window
    ],
)
def test_rtt_estimator_keeps_the_recent_minimum(samples, window, value) -> None:
    estimator = RttEstimator(window=window)
    for sample in samples:
        estimator.observe(sample)
    assert estimator.value == value


def test_rtt_estimator_refuses_a_negative_round_trip() -> None:
    with pytest.raises(ValueError, match="negative"):
        RttEstimator().observe(-0.001)


@pytest.mark.parametrize(
    ("reports", "fit"),
    [
        ([], None),
        ([(0, 0.0), (3, 0.0)], None),  # an idle site teaches nothing
        ([(4, 200.0)], StepTime(0.02, 0.0)),  # 4 sequences at 200 tok/s: 20 ms a step
        ([(4, 200.0), (4, 200.0)], StepTime(0.02, 0.0)),
        # step = 10 ms + 5 ms per sequence: at 2 -> 20 ms (100 tok/s), at 6 -> 40 ms (150 tok/s)
        ([(2, 100.0), (6, 150.0)], StepTime(0.01, 0.005)),
        # bigger batches measured faster per step: no negative slope, flat at the mean
        ([(2, 50.0), (6, 600.0)], StepTime(0.0, 0.0)),
    ],
)
def test_step_time_model_fits_the_reports(reports, fit) -> None:
    model = StepTimeModel()
    for running, rate in reports:
        model.observe(running, rate)
    got = model.fit()
    if fit is None:
        assert got is None
        return
    assert got is not None
    if fit == StepTime(0.0, 0.0):  # the flat case: slope 0, through the weighted mean
        assert got.per_sequence_s == 0.0
        assert 0.01 < got.base_s < 0.04
        return
    assert got.base_s == pytest.approx(fit.base_s, abs=1e-9)
    assert got.per_sequence_s == pytest.approx(fit.per_sequence_s, abs=1e-9)


def test_step_time_model_follows_a_site_that_slows_down() -> None:
    model = StepTimeModel()
    for _ in range(50):
        model.observe(4, 400.0)  # 10 ms
    for _ in range(50):
        model.observe(4, 80.0)  # 50 ms: throttled
    fit = model.fit()
    assert fit is not None
    assert fit.at(4) > 0.045


def test_step_time_model_keeps_the_line_through_the_mean_when_the_base_would_be_negative() -> None:
    model = StepTimeModel()
    model.observe(1, 1000.0)  # 1 ms
    model.observe(10, 100.0)  # 100 ms: steeper than proportional
    fit = model.fit()
    assert fit is not None
    assert fit.base_s == 0.0
    assert fit.at(10) == pytest.approx(10 * fit.at(1))  # proportional, through the mean
    assert 0.001 < fit.at(5) < 0.1


@pytest.mark.parametrize(
    ("req", "site", "ttft", "completion"),
    [
        # idle, unmeasured: prior step 20 ms, one prefill step, 9 more steps
        (request(prompt=50, max_tokens=10), SiteLatency(), 0.02, 0.2),
        # round trip counts once; 250 prompt tokens are 3 chunks of 100
        (
            request(prompt=250, max_tokens=10),
            SiteLatency(rtt_s=0.15, step=STEP),
            0.15 + 0.03,
            0.15 + 0.03 + 0.09,
        ),
        # a free slot: no queue; the step grows with the batch it joins (3 + 1)
        (
            request(prompt=50, max_tokens=11),
            SiteLatency(step=StepTime(0.01, 0.005), batch_slots=8, requests=3),
            0.03,
            0.03 + 10 * 0.03,
        ),
        # full: 4 slots, 6 present, 600 tokens left (100 each): waits for 3 to finish,
        # one every 100 * 10 ms / 4 = 0.25 s
        (
            request(prompt=50, max_tokens=2),
            SiteLatency(step=STEP, batch_slots=4, requests=6, remaining_answer_tokens=600),
            0.75 + 0.01,
            0.75 + 0.02,
        ),
        # the planned answer is the prediction, capped at max_tokens
        (request(prompt=50, max_tokens=5, predicted=100), SiteLatency(step=STEP), 0.01, 0.05),
    ],
)
def test_latency_model(req, site, ttft, completion) -> None:
    predicted = MODEL.predict(req, site)
    assert predicted.ttft_s == pytest.approx(ttft)
    assert predicted.completion_s == pytest.approx(completion)


NEAR_SLOW = Site("near", latency=SiteLatency(rtt_s=0.005, step=StepTime(0.05)))
FAR_FAST = Site("far", latency=SiteLatency(rtt_s=0.15, step=StepTime(0.01)))
FULL_FAST = Site(
    "full",
    latency=SiteLatency(
        rtt_s=0.005, step=StepTime(0.01), batch_slots=2, requests=4, remaining_answer_tokens=2000
    ),
)


@pytest.mark.parametrize(
    ("req", "sites", "chosen"),
    [
        # a long answer: 5x faster decode beats 145 ms more round trip
        (request(prompt=20, max_tokens=100), [NEAR_SLOW, FAR_FAST], "far"),
        # a 2-token answer: the round trip dominates
        (request(prompt=20, max_tokens=2), [NEAR_SLOW, FAR_FAST], "near"),
        # a fast site whose batch is full, with long answers ahead, loses to a slow free one
        (request(prompt=20, max_tokens=50), [FULL_FAST, NEAR_SLOW], "near"),
    ],
)
def test_least_latency_scorer_picks_the_earliest_completion(req, sites, chosen) -> None:
    pick = lowest(PredictedCompletionCost(MODEL)).route(req, sites)
    assert pick.site is not None
    assert pick.site.name == chosen
    assert set(pick.scores) == {site.name for site in sites}


def test_least_latency_policy_is_bounded_by_kv_room() -> None:
    # The far fast site would win on time, but its free KV does not hold prompt + answer.
    full = Site("far", latency=FAR_FAST.latency, kv_capacity_tokens=1000, outstanding_tokens=950)
    decision = build_policy("least_latency").route(
        request(prompt=20, max_tokens=100), [NEAR_SLOW, full]
    )
    assert decision.site is not None
    assert decision.site.name == "near"
    assert dict(decision.survivors)["kv_bound"] == 1


@pytest.mark.parametrize(
    ("req", "site", "score"),
    [
        # the ledger alone: what the site reports (outstanding_tokens) does not count
        (
            request(prompt=10, max_tokens=50, predicted=20),
            Site("a", ledger_tokens=100, outstanding_tokens=900),
            130,
        ),
        (request(prompt=10, max_tokens=50), Site("a", ledger_tokens=40, capacity_weight=2.0), 50),
    ],
)
def test_ledger_tokens_cost(req, site, score) -> None:
    assert LedgerTokensCost().cost(req, site) == score


@pytest.mark.parametrize(
    ("predicted", "max_tokens", "plan", "prompt", "planned"),
    [
        (None, 500, "prompt_ratio", 100, 150),
        (None, 500, "prompt_ratio", 101, math.ceil(151.5)),
        (None, 120, "prompt_ratio", 100, 120),  # capped at max_tokens
        (None, 500, "prompt_ratio", 0, 0),  # no prompt length at hand: nothing, as prompt_only
        (30, 500, "prompt_ratio", 100, 30),  # a prediction wins over any guess
        (None, 500, "prompt_only", 100, 0),
        (None, 500, "max_tokens", 100, 500),
    ],
)
def test_planned_answer_tokens(predicted, max_tokens, plan, prompt, planned) -> None:
    assert planned_answer_tokens(predicted, max_tokens, plan, prompt) == planned
    routing = RoutingRequest("m", prompt, max_tokens, predicted, unpredicted=plan)
    assert routing.answer_tokens == planned
