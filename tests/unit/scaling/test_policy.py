"""The scaling policy on a fake clock: scale-out ahead of the SLO, hysteresis, cooldowns, the
scale-in choice, the bounds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.scaling.policy import (
    ModelObservation,
    ModelState,
    ScaleIn,
    ScaleOut,
    ScalingRule,
    SiteObservation,
    Verdict,
    decide,
)

RULE = ScalingRule(
    "m",
    min_sites=1,
    max_sites=3,
    target_backlog_s=2.0,
    scale_out_at=1.0,
    scale_in_below=0.4,
    lead_time_s=10.0,
    trend_s=2.0,
    out_after_s=1.0,
    in_after_s=30.0,
    out_cooldown_s=5.0,
    in_cooldown_s=60.0,
)


def site(name: str, work_s: float, *, removable: bool = True, cache: int = 0, joined: float = 0.0,
         serving: bool = True) -> SiteObservation:  # fmt: skip
    return SiteObservation(name, serving, removable, work_s, cache, joined)


class Run:
    """Feeds observations to the policy at given times, keeping its state as the controller."""

    def __init__(self, rule: ScalingRule = RULE) -> None:
        self.rule, self.state = rule, ModelState()

    def at(self, now: float, *sites: SiteObservation, pending: int = 0) -> Verdict:
        self.state, verdict = decide(
            self.rule, self.state, ModelObservation("m", sites, pending), now
        )
        return verdict


def test_a_steady_load_under_the_target_holds() -> None:
    run = Run()
    for t in range(0, 100, 1):
        verdict = run.at(float(t), site("a", 1.0))
        assert verdict.action is None
        assert verdict.desired == 1
        assert verdict.backlog_s == pytest.approx(1.0)


def test_scale_out_waits_out_after_s_then_asks_for_what_the_forecast_needs() -> None:
    run = Run()
    assert run.at(0.0, site("a", 1.0)).action is None
    # Work jumps to 5 s on one site: over the 2 s line; 3 sites at most.
    first = run.at(1.0, site("a", 5.0))
    assert first.action is None
    assert first.reason.startswith("high; waiting")
    assert first.desired == 1
    second = run.at(2.0, site("a", 5.5))
    assert isinstance(second.action, ScaleOut)
    assert second.desired == 3
    assert second.action.count == 2
    assert "forecast" in second.reason


def test_a_growing_backlog_scales_out_before_it_crosses_the_line() -> None:
    """The trend, projected one lead time ahead, asks for a site while the backlog itself is
    still under the target: the site is serving when the backlog would have crossed it."""
    run = Run(replace(RULE, out_after_s=0.0))
    verdicts = [run.at(float(t), site("a", 0.2 * t)) for t in range(8)]
    out = next(v for v in verdicts if isinstance(v.action, ScaleOut))
    assert out.backlog_s < RULE.target_backlog_s  # not missed yet
    assert out.forecast_backlog_s > RULE.target_backlog_s


def test_pending_sites_count_so_a_boot_is_not_doubled() -> None:
    run = Run(replace(RULE, out_after_s=0.0, out_cooldown_s=0.0))
    out = run.at(0.0, site("a", 3.0))
    assert out.action == ScaleOut(1)
    # While the new site boots the backlog stays: one site pending covers it.
    assert run.at(1.0, site("a", 3.0), pending=1).action is None
    assert run.at(2.0, site("a", 3.0), pending=1).desired == 2


def test_cooldown_holds_a_second_scale_out() -> None:
    run = Run(replace(RULE, out_after_s=0.0, max_sites=5))
    assert run.at(0.0, site("a", 3.0)).action == ScaleOut(1)
    assert run.at(1.0, site("a", 1.5), site("b", 6.0)).reason == "high; in cooldown"
    assert run.at(4.9, site("a", 1.5), site("b", 6.0)).action is None
    later = run.at(5.0, site("a", 1.5), site("b", 6.0))
    assert isinstance(later.action, ScaleOut)


def test_never_beyond_max_sites() -> None:
    run = Run(replace(RULE, out_after_s=0.0))
    verdict = run.at(0.0, site("a", 100.0), site("b", 100.0), site("c", 100.0))
    assert verdict.action is None
    assert verdict.desired == 3


def test_below_min_sites_starts_at_once() -> None:
    run = Run(replace(RULE, min_sites=2))
    verdict = run.at(0.0, site("a", 0.0))
    assert verdict.action == ScaleOut(1)
    assert verdict.reason == "below min_sites"


def test_scale_in_needs_the_low_backlog_for_in_after_s_and_the_cooldown() -> None:
    run = Run(replace(RULE, in_cooldown_s=0.0))
    low = (site("a", 0.2), site("b", 0.2, joined=5.0))
    times = [0.0, 10.0, 20.0, 29.9]
    assert all(run.at(t, *low).action is None for t in times)
    verdict = run.at(30.0, *low)
    assert verdict.action == ScaleIn("b")  # the newer, equal in cache and work
    assert verdict.desired == 1


def test_hysteresis_a_backlog_between_the_lines_neither_adds_nor_removes() -> None:
    """With one site fewer the backlog would be 1.2 s: under the 2 s scale-out line, over the
    0.8 s scale-in line. Nothing moves, however long."""
    run = Run(replace(RULE, in_cooldown_s=0.0))
    for t in range(0, 300, 5):
        verdict = run.at(float(t), site("a", 0.6), site("b", 0.6))
        assert verdict.action is None
        assert verdict.desired == 2


def test_a_blip_restarts_the_scale_in_wait() -> None:
    run = Run(replace(RULE, in_cooldown_s=0.0))
    quiet = (site("a", 0.1), site("b", 0.1))
    assert run.at(0.0, *quiet).action is None
    assert run.at(20.0, *quiet).action is None
    assert run.at(21.0, site("a", 1.5), site("b", 1.5)).action is None  # the blip
    assert run.at(40.0, *quiet).action is None  # low again: the wait starts over here
    assert run.at(69.9, *quiet).action is None
    assert isinstance(run.at(70.0, *quiet).action, ScaleIn)


def test_scale_in_cooldown_after_a_scale_out() -> None:
    run = Run(replace(RULE, out_after_s=0.0, in_after_s=0.0))
    assert run.at(0.0, site("a", 3.0)).action == ScaleOut(1)
    quiet = (site("a", 0.0), site("b", 0.0))
    assert run.at(30.0, *quiet).reason == "low; in cooldown"
    assert isinstance(run.at(60.0, *quiet).action, ScaleIn)


def test_no_scale_in_while_the_backlog_grows_or_a_site_boots() -> None:
    run = Run(replace(RULE, in_after_s=0.0, in_cooldown_s=0.0))
    assert run.at(0.0, site("a", 0.0), site("b", 0.0), pending=1).action is None
    # Growing: its forecast with one site fewer is over the line (0.8 s), though the level
    # (0.6 s) is under it.
    growing = Run(replace(RULE, in_after_s=0.0, in_cooldown_s=0.0, lead_time_s=10.0))
    growing.at(0.0, site("a", 0.0), site("b", 0.0))
    assert growing.at(1.0, site("a", 0.3), site("b", 0.3)).action is None


def test_a_steady_but_noisy_backlog_under_the_line_still_scales_in() -> None:
    """At a steady load the trend's sign flips with every report: noise alone must not hold a
    surplus site (it did, for a whole GPU run)."""
    run = Run(replace(RULE, in_after_s=5.0, in_cooldown_s=0.0, lead_time_s=1.0))
    verdicts = [
        run.at(t / 2, site("a", 0.1 + 0.05 * (t % 2)), site("b", 0.1 + 0.05 * (t % 2)))
        for t in range(40)
    ]
    assert any(isinstance(v.action, ScaleIn) for v in verdicts)


def test_the_site_whose_cache_is_worth_least_goes_first() -> None:
    run = Run(replace(RULE, in_after_s=0.0, in_cooldown_s=0.0))
    verdict = run.at(
        0.0,
        site("warm", 0.1, cache=900),
        site("cool", 0.1, cache=40),
        site("fixed", 0.0, cache=0, removable=False),  # the federation file's: never taken
    )
    assert verdict.action == ScaleIn("cool")


def test_between_equal_caches_the_one_with_least_work_goes() -> None:
    run = Run(replace(RULE, in_after_s=0.0, in_cooldown_s=0.0, max_sites=4))
    verdict = run.at(0.0, site("a", 0.05, cache=10), site("b", 0.2, cache=10), site("c", 0.1))
    assert verdict.action == ScaleIn("c")  # no cache at all
    verdict = Run(replace(RULE, in_after_s=0.0, in_cooldown_s=0.0)).at(
        0.0, site("a", 0.3, cache=10), site("b", 0.05, cache=10)
    )
    assert verdict.action == ScaleIn("b")


def test_nothing_removable_nothing_removed() -> None:
    run = Run(replace(RULE, in_after_s=0.0, in_cooldown_s=0.0))
    verdict = run.at(0.0, site("a", 0.0, removable=False), site("b", 0.0, removable=False))
    assert verdict.action is None
    assert verdict.desired == 2


def test_a_site_not_serving_is_not_capacity() -> None:
    """An unhealthy or draining site's work is not counted and it is not a site: the model is
    short of one and asks for it."""
    run = Run(replace(RULE, out_after_s=0.0, min_sites=2))
    verdict = run.at(0.0, site("a", 0.5), site("b", 9.0, serving=False))
    assert verdict.serving == 1
    assert verdict.action == ScaleOut(1)
    assert verdict.backlog_s == pytest.approx(0.5)


def test_scale_to_zero_only_when_idle() -> None:
    run = Run(replace(RULE, min_sites=0, in_after_s=0.0, in_cooldown_s=0.0))
    assert run.at(0.0, site("a", 0.01)).action is None
    assert run.at(100.0, site("a", 0.0)).action == ScaleIn("a")
    idle = Run(replace(RULE, min_sites=0))
    assert idle.at(0.0).action is None  # no site, no work: nothing to start
    assert idle.at(1.0).desired == 0


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="min_sites"):
        ScalingRule("m", min_sites=3, max_sites=2)
    with pytest.raises(ValueError, match="scale_in_below"):
        ScalingRule("m", scale_in_below=1.0, scale_out_at=1.0)
    with pytest.raises(ValueError, match="target_backlog_s"):
        ScalingRule("m", target_backlog_s=0.0)
