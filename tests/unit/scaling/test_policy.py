"""The scaling policy on a fake clock: scale-out ahead of the SLO from the arrival rate,
scale-in on the smoothed level, hysteresis, cooldowns, the scale-in choice, the bounds."""

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

# The rule's priors: 1,000 answer tokens (or 10,000 prompt tokens) are one second of a site.
RULE = ScalingRule(
    "m",
    min_sites=1,
    max_sites=3,
    target_backlog_s=2.0,
    scale_out_at=1.0,
    scale_in_below=0.4,
    lead_time_s=10.0,
    rate_s=2.0,
    settle_s=0.0,  # the start-up settling: test_start_misread.py
    in_window_s=30.0,
    in_headroom=0.2,
    out_after_s=1.0,
    in_after_s=0.0,
    out_cooldown_s=5.0,
    in_cooldown_s=60.0,
)


def site(name: str, work_s: float, *, removable: bool = True, cache: int = 0, joined: float = 0.0,
         serving: bool = True) -> SiteObservation:  # fmt: skip
    return SiteObservation(name, serving, removable, work_s, cache, joined)


class Run:
    """Feeds observations to the policy at given times, keeping its state as the controller
    does; `arrive` adds predicted work (seconds of a site) to the model's admitted counters."""

    def __init__(self, rule: ScalingRule = RULE) -> None:
        self.rule, self.state = rule, ModelState()
        self.answer_tokens = 0.0

    def arrive(self, work_s: float) -> None:
        self.answer_tokens += work_s * self.rule.site_tokens_per_s

    def at(
        self, now: float, *sites: SiteObservation, pending: int = 0, start_s: float | None = None
    ) -> Verdict:
        observed = ModelObservation(
            "m", sites, pending, arrived_answer_tokens=round(self.answer_tokens), start_s=start_s
        )
        self.state, verdict = decide(self.rule, self.state, observed, now)
        return verdict


class Fluid:
    """A model's sites as a fluid queue on a fake clock: work arrives at `rate(t)` seconds of a
    site per second and each serving site does one second of it per second. New sites serve
    `start_s` after the policy asks for them; a site asked away leaves at once (its drain is
    the membership's, not the policy's)."""

    def __init__(self, rule: ScalingRule, sites: int = 1, start_s: float = 18.0) -> None:
        self.run = Run(rule)
        self.sites, self.start_s = sites, start_s
        self.work = 0.0
        self.booting: list[float] = []  # when each asked-for site serves
        self.verdicts: list[tuple[float, Verdict]] = []

    def step(self, now: float, dt: float, rate: float) -> Verdict:
        arrived = rate * dt
        self.run.arrive(arrived)
        self.work = max(0.0, self.work + arrived - self.sites * dt)
        self.sites += sum(at <= now for at in self.booting)
        self.booting = [at for at in self.booting if at > now]
        # What arrived over the last tick is still running when observed.
        seen = (self.work + arrived) / self.sites
        names = [site(f"s{i}", seen, joined=float(i)) for i in range(self.sites)]
        verdict = self.run.at(now, *names, pending=len(self.booting), start_s=self.start_s)
        if isinstance(verdict.action, ScaleOut):
            self.booting += [now + self.start_s] * verdict.action.count
        elif isinstance(verdict.action, ScaleIn):
            self.sites -= 1
        self.verdicts.append((now, verdict))
        return verdict

    def actions(self) -> list[tuple[float, ScaleOut | ScaleIn]]:
        return [(t, v.action) for t, v in self.verdicts if v.action is not None]


def noisy(t: float, mean: float) -> float:
    """A deterministic, bursty load around `mean`: +-60% from tick to tick."""
    return mean * (1.0 + 0.6 * ((int(t * 2) * 7919) % 11 - 5) / 5)


def test_a_steady_load_under_the_target_holds() -> None:
    run = Run()
    for t in range(100):
        run.arrive(0.5)
        verdict = run.at(float(t), site("a", 1.0))
        assert verdict.action is None
        assert verdict.desired == 1
        assert verdict.backlog_s == pytest.approx(1.0)
    assert verdict.arrival_rate == pytest.approx(0.5)


def test_a_load_step_scales_out_before_the_backlog_crosses_the_target() -> None:
    """1x (0.45 of a site) -> 3x (1.35): the arrivals show the step at once, the backlog only
    builds at 0.35 s a second. The scale-out is asked while the backlog is under the target,
    before it crosses it: a reactive policy (the backlog, or its trend, over the line) asks at
    the crossing at the earliest."""
    rule = replace(RULE, max_sites=2, out_after_s=0.5, rate_s=1.0)
    fluid, alone = Fluid(rule), Fluid(rule)
    alone.run.rule = replace(rule, max_sites=1)  # the same load on one site, never helped
    crossed = None
    for tick in range(2 * 130):
        now = tick / 2
        rate = 0.45 if now < 100 else 1.35
        fluid.step(now, 0.5, rate)
        alone.step(now, 0.5, rate)
        if crossed is None and alone.verdicts[-1][1].backlog_s > rule.target_backlog_s:
            crossed = now  # what a reactive policy sees over the line, at the earliest
    assert crossed is not None
    assert crossed > 103
    ((asked, action),) = fluid.actions()
    assert action == ScaleOut(1)
    verdict = dict(fluid.verdicts)[asked]
    # Asked 1.5 s into the step, 2 s before a reactive policy (the backlog, or its trend, over
    # the line) could see anything, and that one would wait its out_after_s on top.
    assert 100 < asked <= 101.5
    assert crossed - asked >= 2.0
    assert verdict.backlog_s < rule.target_backlog_s  # not missed yet
    assert verdict.lead_s == 18.0  # the measured start, not the rule's prior
    assert "arrivals" in verdict.reason
    assert "lead 18s" in verdict.reason
    # The new site serves 18 s later, the two work the queue off: back under the target by
    # 130 s while one site alone would be four times over it.
    assert dict(fluid.verdicts)[129.5].backlog_s < rule.target_backlog_s
    assert dict(alone.verdicts)[129.5].backlog_s > 4 * rule.target_backlog_s


def test_a_slow_ramp_scales_out_before_the_backlog_grows() -> None:
    """Arrivals rising by 1% of a site a second outgrow one site at 70 s; its backlog would
    cross the target at 90 s. The scale-out is asked while the backlog is still a fraction of
    the target."""
    rule = replace(RULE, max_sites=2, out_after_s=0.0)
    fluid = Fluid(rule, start_s=30.0)
    for tick in range(2 * 200):
        now = tick / 2
        fluid.step(now, 0.5, 0.3 + 0.01 * now)
    ((asked, action),) = fluid.actions()
    assert action == ScaleOut(1)
    assert asked < 80
    assert dict(fluid.verdicts)[asked].backlog_s < 0.5 * rule.target_backlog_s


def test_noisy_load_does_not_flap() -> None:
    """A bursty load that one site of two could not absorb with headroom (0.9 of one) and two
    hold easily: never a scale-in, never a scale-out, over ten minutes."""
    rule = replace(RULE, max_sites=2, in_cooldown_s=0.0, out_cooldown_s=0.0)
    fluid = Fluid(rule, sites=2)
    for tick in range(2 * 600):
        now = tick / 2
        fluid.step(now, 0.5, noisy(now, 0.9))
    assert fluid.actions() == []
    # The instantaneous backlog swung; the smoothed level did not.
    levels = [v.level_s for t, v in fluid.verdicts if t > rule.in_window_s]
    backlogs = [v.backlog_s for t, v in fluid.verdicts if t > rule.in_window_s]
    assert max(backlogs) - min(backlogs) > 2 * (max(levels) - min(levels))


def test_noisy_light_load_scales_in_once_and_stays() -> None:
    """A bursty load of 0.3 of a site on two: one goes within the window, and the other stays
    for good (no scale-out undoes it)."""
    rule = replace(RULE, max_sites=2, in_cooldown_s=0.0, out_cooldown_s=0.0)
    fluid = Fluid(rule, sites=2)
    for tick in range(2 * 600):
        now = tick / 2
        fluid.step(now, 0.5, noisy(now, 0.3))
    ((at, action),) = fluid.actions()
    assert isinstance(action, ScaleIn)
    assert at <= rule.in_window_s + 1.0


def test_scale_in_follows_the_load_down_within_the_window() -> None:
    """3x on two sites, then 1x: one site goes after the fall, within one window (and not
    before the window's mean has fallen), and nothing scales out again."""
    rule = replace(RULE, max_sites=2, in_cooldown_s=10.0)
    fluid = Fluid(rule, sites=2)
    for tick in range(2 * 260):
        now = tick / 2
        fluid.step(now, 0.5, 1.35 if now < 150 else 0.45)
    ((at, action),) = fluid.actions()
    assert isinstance(action, ScaleIn)
    assert 150 < at <= 150 + rule.in_window_s
    assert "mean with 1 site(s)" in dict(fluid.verdicts)[at].reason


def test_scale_out_waits_out_after_s_then_asks_for_what_the_forecast_needs() -> None:
    run = Run()
    run.at(0.0, site("a", 1.0))
    # 3.2 s of work a second arrive on one site: 3 sites needed (max 3).
    run.arrive(3.2)
    first = run.at(1.0, site("a", 4.0))
    assert first.action is None
    assert first.reason.startswith("high; waiting")
    assert first.desired == 1
    run.arrive(3.2)
    second = run.at(2.0, site("a", 6.0))
    assert isinstance(second.action, ScaleOut)
    assert second.desired == 3
    assert second.action.count == 2
    assert second.reason.startswith("forecast")


def test_a_backlog_draining_fast_enough_needs_no_site() -> None:
    """3 s of work on one site over the line, but nothing arrives: within the lead time it is
    served, so the forecast is under the line."""
    run = Run(replace(RULE, out_after_s=0.0))
    run.at(0.0, site("a", 3.0))
    verdict = run.at(1.0, site("a", 3.0))
    assert verdict.action is None
    assert verdict.forecast_backlog_s == 0.0


def test_pending_sites_count_so_a_boot_is_not_doubled() -> None:
    run = Run(replace(RULE, out_after_s=0.0, out_cooldown_s=0.0))
    run.at(0.0, site("a", 2.5))
    run.arrive(1.1)
    out = run.at(1.0, site("a", 2.5))  # forecast 2.5 + (1.1 - 1) x 10 = 3.5 s: two sites
    assert out.action == ScaleOut(1)
    # While the new site boots the backlog stays: one site pending covers it.
    run.arrive(1.1)
    assert run.at(2.0, site("a", 2.5), pending=1).action is None
    run.arrive(1.1)
    assert run.at(3.0, site("a", 2.5), pending=1).desired == 2


def test_cooldown_holds_a_second_scale_out() -> None:
    run = Run(replace(RULE, out_after_s=0.0, max_sites=5))
    run.at(0.0, site("a", 2.5))
    run.arrive(1.1)
    assert run.at(1.0, site("a", 2.5)).action == ScaleOut(1)
    for now in (2.0, 3.0, 4.0, 5.9):
        run.arrive(4.0)
        verdict = run.at(now, site("a", 3.0), site("b", 6.0))
        assert verdict.reason == "high; in cooldown", now
    run.arrive(4.0)
    later = run.at(6.0, site("a", 3.0), site("b", 6.0))
    assert isinstance(later.action, ScaleOut)


def test_never_beyond_max_sites() -> None:
    run = Run(replace(RULE, out_after_s=0.0))
    run.at(0.0, site("a", 100.0), site("b", 100.0), site("c", 100.0))
    run.arrive(10.0)
    verdict = run.at(1.0, site("a", 100.0), site("b", 100.0), site("c", 100.0))
    assert verdict.action is None
    assert verdict.desired == 3


def test_below_min_sites_starts_at_once() -> None:
    run = Run(replace(RULE, min_sites=2))
    verdict = run.at(0.0, site("a", 0.0))
    assert verdict.action == ScaleOut(1)
    assert verdict.reason == "below min_sites"


def test_the_lead_is_the_rule_s_until_a_start_is_measured() -> None:
    run = Run()
    assert run.at(0.0, site("a", 0.0)).lead_s == RULE.lead_time_s
    assert run.at(1.0, site("a", 0.0), start_s=42.0).lead_s == 42.0


def quiet_until(run: Run, end: float, *sites: SiteObservation) -> Verdict:
    """Observes the sites with nothing arriving, every second from 0 to `end`: the first
    verdict that acts, else the last."""
    verdict = run.at(0.0, *sites)
    for now in range(1, int(end) + 1):
        if verdict.action is not None:
            break
        verdict = run.at(float(now), *sites)
    return verdict


def test_scale_in_waits_for_a_full_window_and_the_cooldown() -> None:
    run = Run(replace(RULE, in_cooldown_s=0.0))
    low = (site("a", 0.2), site("b", 0.2, joined=5.0))
    assert quiet_until(run, 29.0, *low).reason == "holding; smoothing window not full"
    verdict = run.at(30.0, *low)
    assert verdict.action == ScaleIn("b")  # the newer, equal in cache and work
    assert verdict.desired == 1


def test_scale_in_cooldown_after_a_scale_out() -> None:
    run = Run(replace(RULE, out_after_s=0.0, in_window_s=5.0))
    run.at(0.0, site("a", 2.5))
    run.arrive(1.1)
    assert run.at(1.0, site("a", 2.5)).action == ScaleOut(1)
    quiet = (site("a", 0.0), site("b", 0.0))
    for now in range(2, 61):
        verdict = run.at(float(now), *quiet)
        if now < 61 and now >= 7:
            assert verdict.reason == "low; in cooldown", now
    assert isinstance(run.at(61.0, *quiet).action, ScaleIn)


def test_hysteresis_a_level_between_the_lines_neither_adds_nor_removes() -> None:
    """With one site fewer the backlog would be 1.2 s: under the 2 s scale-out line, over the
    0.8 s scale-in line. Nothing moves, however long."""
    run = Run(replace(RULE, in_cooldown_s=0.0))
    for t in range(0, 300, 5):
        run.arrive(5 * 0.3)
        verdict = run.at(float(t), site("a", 0.6), site("b", 0.6))
        assert verdict.action is None
        assert verdict.desired == 2
    assert verdict.reason == "holding; smoothed backlog over the scale-in line"


def test_a_blip_moves_the_mean_not_the_decision() -> None:
    """One high observation in a quiet window: the mean with one site fewer stays under the
    line, so the scale-in goes ahead when the window is full (the old instantaneous rule
    restarted its wait at every blip)."""
    run = Run(replace(RULE, in_cooldown_s=0.0))
    quiet = (site("a", 0.1), site("b", 0.1))
    quiet_until(run, 20.0, *quiet)
    run.at(21.0, site("a", 1.5), site("b", 1.5))  # the blip, held one second
    for now in range(22, 30):
        assert run.at(float(now), *quiet).action is None
    assert isinstance(run.at(30.0, *quiet).action, ScaleIn)


def test_no_scale_in_while_the_remaining_site_could_not_absorb_the_arrivals() -> None:
    run = Run(replace(RULE, in_cooldown_s=0.0))
    for now in range(100):
        run.arrive(0.85)  # 0.85 of one site: over its 0.8 with the headroom
        verdict = run.at(float(now), site("a", 0.1), site("b", 0.1))
        assert verdict.action is None
    assert verdict.reason == "holding; arrivals need the site"


def test_no_scale_in_while_a_site_boots() -> None:
    run = Run(replace(RULE, in_cooldown_s=0.0))
    verdict = quiet_until(run, 100.0, site("a", 0.0), site("b", 0.0))
    assert isinstance(verdict.action, ScaleIn)
    booting = Run(replace(RULE, in_cooldown_s=0.0))
    pending = [booting.at(float(t), site("a", 0.0), site("b", 0.0), pending=1) for t in range(99)]
    assert all(v.action is None for v in pending)


def test_the_site_whose_cache_is_worth_least_goes_first() -> None:
    run = Run(replace(RULE, in_cooldown_s=0.0))
    verdict = quiet_until(
        run,
        30.0,
        site("warm", 0.1, cache=900),
        site("cool", 0.1, cache=40),
        site("fixed", 0.0, cache=0, removable=False),  # the federation file's: never taken
    )
    assert verdict.action == ScaleIn("cool")


def test_between_equal_caches_the_one_with_least_work_goes() -> None:
    run = Run(replace(RULE, in_cooldown_s=0.0, max_sites=4))
    three = (site("a", 0.05, cache=10), site("b", 0.2, cache=10), site("c", 0.1))
    assert quiet_until(run, 30.0, *three).action == ScaleIn("c")  # no cache at all
    run = Run(replace(RULE, in_cooldown_s=0.0))
    two = (site("a", 0.3, cache=10), site("b", 0.05, cache=10))
    assert quiet_until(run, 30.0, *two).action == ScaleIn("b")


def test_nothing_removable_nothing_removed() -> None:
    run = Run(replace(RULE, in_cooldown_s=0.0))
    verdict = quiet_until(
        run, 100.0, site("a", 0.0, removable=False), site("b", 0.0, removable=False)
    )
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
    rule = replace(RULE, min_sites=0, in_cooldown_s=0.0)
    busy = Run(rule)
    for now in range(100):
        busy.arrive(0.01)
        assert busy.at(float(now), site("a", 0.0)).action is None
    assert quiet_until(Run(rule), 30.0, site("a", 0.0)).action == ScaleIn("a")
    idle = Run(rule)
    assert idle.at(0.0).action is None  # no site, no work: nothing to start
    assert idle.at(1.0).desired == 0


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="min_sites"):
        ScalingRule("m", min_sites=3, max_sites=2)
    with pytest.raises(ValueError, match="scale_in_below"):
        ScalingRule("m", scale_in_below=1.0, scale_out_at=1.0)
    with pytest.raises(ValueError, match="target_backlog_s"):
        ScalingRule("m", target_backlog_s=0.0)
    with pytest.raises(ValueError, match="in_headroom"):
        ScalingRule("m", in_headroom=1.0)
    with pytest.raises(ValueError, match="in_window_s"):
        ScalingRule("m", in_window_s=0.0)
