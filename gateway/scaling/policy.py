"""The scaling policy: a model's predicted work -> how many sites should serve it.

A pure function of the rule, the model's last state, what is observed now and the clock, so it
is tested on a fake clock (tests/unit/scaling/) and reads nothing else.

- **Backlog.** Each serving site's work is the prompt tokens it has queued over its prefill
  rate plus the predicted answer tokens still to come (queued and running) over its decode
  throughput at a full batch: seconds of that site's time (gateway/scaling/observe.py). The
  model's backlog per site is their sum over the serving sites, over their number: with the
  router keeping them balanced, how long a new request's work waits behind the others'.
- **Scale-out before the SLO is missed.** The backlog's trend (smoothed over `trend_s`) projects
  it `lead_time_s` ahead, about what a new site takes to serve: the sites that forecast needs at
  `target_backlog_s x scale_out_at` each are asked for once the forecast has been over for
  `out_after_s`, and not within `out_cooldown_s` of the last step. Sites still starting count as
  serving (no second start while the first boots). Below `min_sites`: at once.
- **Scale-in by draining, with hysteresis.** One site fewer is decided only when the forecast
  backlog (its growth included) with one site fewer stays below `target_backlog_s x
  scale_in_below` (under the scale-out threshold: no flapping between the two) for
  `in_after_s`: a backlog that grows crosses the line and restarts the wait. The trend's sign
  alone is not asked: it is noise at a steady load and would hold a surplus site forever. No site is
  starting, and not within `in_cooldown_s` of the last step. The site that goes is, among those
  the actuator may take away, the one whose cache is worth least (fewest prefix blocks the
  gateway knows it holds), then the one with the least work to finish, then the newest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class ScalingRule:
    """How one model's capacity follows its load (the scaling file's entry for it)."""

    model: str
    min_sites: int = 1
    max_sites: int = 2
    # Seconds of work per serving site the controller holds the model at (the TTFT SLO's share
    # left to queueing).
    target_backlog_s: float = 2.0
    # Scale out when the forecast per site exceeds target x this; scale in when the backlog with
    # one site fewer stays under target x scale_in_below.
    scale_out_at: float = 1.0
    scale_in_below: float = 0.4
    # How far ahead the forecast looks: about what a new site takes to serve.
    lead_time_s: float = 30.0
    # How long the backlog's trend is smoothed over (its exponential time constant).
    trend_s: float = 10.0
    # How long a condition must hold before it acts.
    out_after_s: float = 0.0
    in_after_s: float = 60.0
    # No scale-out (scale-in) within this long of the model's last step either way.
    out_cooldown_s: float = 15.0
    in_cooldown_s: float = 120.0
    # A site's decode throughput at a full batch (tokens/s) and its prefill rate, until its
    # reports (or its same-model peers') measure them.
    site_tokens_per_s: float = 1000.0
    site_prefill_tokens_per_s: float = 10000.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_sites <= self.max_sites or self.max_sites < 1:
            raise ValueError(f"{self.model}: need 0 <= min_sites <= max_sites, max_sites >= 1")
        if not 0 < self.scale_in_below < self.scale_out_at:
            raise ValueError(f"{self.model}: need 0 < scale_in_below < scale_out_at")
        positive = ("target_backlog_s", "trend_s", "site_tokens_per_s", "site_prefill_tokens_per_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.model}: {name} must be > 0")
        waits = ("lead_time_s", "out_after_s", "in_after_s", "out_cooldown_s", "in_cooldown_s")
        for name in waits:
            if getattr(self, name) < 0:
                raise ValueError(f"{self.model}: {name} must be >= 0")


@dataclass(frozen=True, slots=True)
class SiteObservation:
    name: str
    # Healthy and not draining: it takes new work.
    serving: bool
    # The actuator may take it away (it started it; under Kubernetes, the pod the StatefulSet
    # removes next).
    removable: bool
    # Seconds of this site's time its queued and running work needs (observe.py).
    work_s: float
    # Prefix-cache blocks the gateway knows it holds (what losing it costs the requests to come).
    cache_blocks: int = 0
    # When it joined (the controller's clock; 0: at the start).
    joined_at: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelObservation:
    model: str
    sites: tuple[SiteObservation, ...]
    # Sites the actuator was asked for that do not serve yet.
    pending: int = 0

    @property
    def serving(self) -> tuple[SiteObservation, ...]:
        return tuple(site for site in self.sites if site.serving)


@dataclass(frozen=True, slots=True)
class ModelState:
    """What the policy remembers of a model between observations."""

    work_s: float | None = None  # the total work last observed
    at: float | None = None  # and when
    trend: float = 0.0  # smoothed d(work)/dt, seconds of work per second
    over_since: float | None = None  # the forecast has been over the scale-out line since
    under_since: float | None = None  # the scale-in condition has held since
    last_step_at: float | None = None  # the last scale-out or scale-in
    desired: int | None = None  # the last verdict's sites


@dataclass(frozen=True, slots=True)
class ScaleOut:
    count: int


@dataclass(frozen=True, slots=True)
class ScaleIn:
    site: str


@dataclass(frozen=True, slots=True)
class Verdict:
    serving: int
    pending: int
    desired: int
    backlog_s: float  # per serving site, now
    forecast_backlog_s: float  # per site (serving + pending), one lead time ahead
    action: ScaleOut | ScaleIn | None
    reason: str


@dataclass(frozen=True, slots=True)
class _Seen:
    """One observation reduced to what the policy weighs."""

    serving: int
    pending: int
    work_s: float  # total, seconds of one site's time
    forecast_s: float  # total, one lead time ahead
    trend: float

    @property
    def sites(self) -> int:
        return self.serving + self.pending

    def verdict(self, desired: int, action: ScaleOut | ScaleIn | None, reason: str) -> Verdict:
        return Verdict(
            self.serving,
            self.pending,
            desired,
            _per_site(self.work_s, self.serving),
            _per_site(self.forecast_s, self.sites),
            action,
            reason,
        )


def decide(
    rule: ScalingRule, state: ModelState, observed: ModelObservation, now: float
) -> tuple[ModelState, Verdict]:
    """The module docstring's policy: the model's new state and what to do now."""
    serving = observed.serving
    work = sum(site.work_s for site in serving)
    trend = _trend(rule, state, work, now)
    seen = _Seen(
        len(serving), observed.pending, work, work + max(trend, 0.0) * rule.lead_time_s, trend
    )
    state = replace(state, work_s=work, at=now, trend=trend)
    if seen.sites < rule.min_sites:
        state = replace(state, last_step_at=now, over_since=None, under_since=None)
        action = ScaleOut(rule.min_sites - seen.sites)
        return _with(state, seen.verdict(rule.min_sites, action, "below min_sites"))
    out_line = rule.target_backlog_s * rule.scale_out_at
    needed = min(rule.max_sites, max(rule.min_sites, math.ceil(seen.forecast_s / out_line)))
    if needed > seen.sites:
        return _scale_out(rule, replace(state, under_since=None), seen, needed, now)
    return _scale_in(rule, replace(state, over_since=None), seen, serving, now)


def _scale_out(
    rule: ScalingRule, state: ModelState, seen: _Seen, needed: int, now: float
) -> tuple[ModelState, Verdict]:
    over_since = state.over_since if state.over_since is not None else now
    state = replace(state, over_since=over_since)
    if now - over_since < rule.out_after_s:
        return _with(state, seen.verdict(seen.sites, None, "high; waiting out_after_s"))
    if _cooling(state, now, rule.out_cooldown_s):
        return _with(state, seen.verdict(seen.sites, None, "high; in cooldown"))
    state = replace(state, last_step_at=now, over_since=None)
    line = rule.target_backlog_s * rule.scale_out_at
    reason = (
        f"forecast {_per_site(seen.forecast_s, seen.sites):.2f}s per site over {line:.2f}s "
        f"(backlog {_per_site(seen.work_s, seen.serving):.2f}s, trend {seen.trend:+.2f}/s, "
        f"lead {rule.lead_time_s:g}s): {needed} site(s)"
    )
    return _with(state, seen.verdict(needed, ScaleOut(needed - seen.sites), reason))


def _scale_in(
    rule: ScalingRule,
    state: ModelState,
    seen: _Seen,
    serving: tuple[SiteObservation, ...],
    now: float,
) -> tuple[ModelState, Verdict]:
    fewer = seen.serving - 1
    in_line = rule.target_backlog_s * rule.scale_in_below
    low = (
        seen.pending == 0
        and seen.serving > rule.min_sites
        and (seen.forecast_s / fewer < in_line if fewer > 0 else seen.forecast_s == 0.0)
    )
    victim = _victim(serving)
    if not low or victim is None:
        return _with(replace(state, under_since=None), seen.verdict(seen.sites, None, "holding"))
    under_since = state.under_since if state.under_since is not None else now
    state = replace(state, under_since=under_since)
    if now - under_since < rule.in_after_s:
        return _with(state, seen.verdict(seen.sites, None, "low; waiting in_after_s"))
    if _cooling(state, now, rule.in_cooldown_s):
        return _with(state, seen.verdict(seen.sites, None, "low; in cooldown"))
    state = replace(state, last_step_at=now, under_since=None)
    reason = (
        f"backlog with {fewer} site(s) {_per_site(seen.forecast_s, fewer):.2f}s under "
        f"{in_line:.2f}s for {rule.in_after_s:g}s; {victim.name} holds the least cache "
        f"({victim.cache_blocks} blocks)"
    )
    return _with(state, seen.verdict(seen.serving - 1, ScaleIn(victim.name), reason))


def _per_site(total: float, sites: int) -> float:
    if sites > 0:
        return total / sites
    return math.inf if total > 0 else 0.0


def _with(state: ModelState, verdict: Verdict) -> tuple[ModelState, Verdict]:
    return replace(state, desired=verdict.desired), verdict


def _cooling(state: ModelState, now: float, cooldown_s: float) -> bool:
    return state.last_step_at is not None and now - state.last_step_at < cooldown_s


def _trend(rule: ScalingRule, state: ModelState, work: float, now: float) -> float:
    """The work's rate of change, exponentially smoothed with time constant `trend_s`."""
    if state.work_s is None or state.at is None or now <= state.at:
        return state.trend
    dt = now - state.at
    instant = (work - state.work_s) / dt
    weight = 1.0 - math.exp(-dt / rule.trend_s)
    return state.trend + weight * (instant - state.trend)


def _victim(serving: tuple[SiteObservation, ...]) -> SiteObservation | None:
    """The removable site whose cache is worth least, then with the least work, then newest."""
    removable = [site for site in serving if site.removable]
    if not removable:
        return None
    return min(removable, key=lambda s: (s.cache_blocks, s.work_s, -s.joined_at, s.name))
