"""The scaling policy: a model's predicted work -> how many sites should serve it.

A pure function of the rule, the model's last state, what is observed now and the clock, so it
is tested on a fake clock (tests/unit/scaling/) and reads nothing else.

- **Backlog.** Each serving site's work is the prompt tokens it has queued over its prefill
  rate plus the predicted answer tokens still to come (queued and running) over its decode
  throughput at a full batch: seconds of that site's time (gateway/scaling/observe.py). The
  model's backlog is their sum over the serving sites; per site, how long a new request's work
  waits behind the others' with the router keeping them balanced.
- **Arrivals.** Every admitted request's prompt and predicted answer tokens, in the same
  seconds of a site's time, per second, smoothed over `rate_s` (gateway/scaling/forecast.py).
  A busy site does one second of work per second (its throughput as measured), so `n` sites
  serve `n` seconds of work per second.
- **Scale-out before the SLO is missed.** The backlog a new site's start ahead (`lead`: the
  actuator's measured start, else `lead_time_s`) is forecast as `backlog + (arrivals - sites)
  x lead` (no less than zero; sites still starting count as serving, so a boot is never
  doubled). Once that forecast per site has been over `target_backlog_s x scale_out_at` for
  `out_after_s`, and not within `out_cooldown_s` of the last step, the controller asks for one
  site more, or as many as spread the forecast under the line or absorb the arrivals with
  `in_headroom` to spare (up to `max_sites`). A load step shows in the arrivals at once, long
  before the backlog it builds crosses the line. Below `min_sites`: at once.
- **Settling.** For `settle_s` after the model's first arrivals the forecast looks no further
  than now where the arrivals exceed the sites (the backlog itself must be over the line): the
  sites' rates that price the arrivals
  are the rule's priors until reported, then measured on sites serving their first requests
  cold, and a rate extrapolated a lead (~20 s) ahead from them scaled out seed 1 of the GPU
  bench 3.8 s into 1x load (docs/elastic.md, tests/unit/scaling/test_start_misread.py).
- **Scale-in on a smoothed level, by draining.** One site fewer is decided when, over the last
  `in_window_s` (since the last step: a level measured with other sites says nothing of these),
  the time-weighted mean backlog with one site fewer is under `target_backlog_s x
  scale_in_below`, the remaining sites absorb the arrivals (the larger of their window mean and
  their smoothed rate now) at no more than `1 - in_headroom` of their throughput, and the
  forecast with one site fewer is under the scale-out line (so that the next tick does not
  undo it); held for `in_after_s`, no site starting, and not within `in_cooldown_s` of the last
  step. A noisy instantaneous backlog moves the window's mean little: no flapping. The site that
  goes is, among those the actuator may take away, the one whose cache is worth least (fewest
  prefix blocks the gateway knows it holds), then the one with the least work, then the newest.
- **How long the peak lasts.** A scale-out says how long the forecast's excess lasts (`peak_s`):
  with the arrivals under the sites' throughput, the time the sites take to bring the backlog
  back under the line by themselves; with the arrivals at or over it, unbounded (the peak lasts
  as long as the arrivals stay high). One no longer than `short_peak_s` (0: never) is short: the
  new site belongs in idle memory on a GPU already held (gateway/scaling/idle_memory.py; no
  actuator acts on it yet, docs/elastic.md says what is missing), a new GPU otherwise.

Every verdict carries its inputs (backlog, arrivals, lead, forecast, smoothed level) and says
them in its reason: the scaling events and the metrics explain each decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gateway.scaling.forecast import Flow


@dataclass(frozen=True, slots=True)
class ScalingRule:
    """How one model's capacity follows its load (the scaling file's entry for it)."""

    model: str
    min_sites: int = 1
    max_sites: int = 2
    # Seconds of work per serving site the controller holds the model at (the TTFT SLO's share
    # left to queueing).
    target_backlog_s: float = 2.0
    # Scale out when the forecast per site exceeds target x this; scale in when the smoothed
    # backlog with one site fewer is under target x scale_in_below.
    scale_out_at: float = 1.0
    scale_in_below: float = 0.4
    # How far ahead the forecast looks until the actuator has measured a site's start.
    lead_time_s: float = 30.0
    # The arrival rate's smoothing (its exponential time constant), and how long after the
    # model's first arrivals the forecast starts to look ahead (module docstring: settling).
    rate_s: float = 5.0
    settle_s: float = 10.0
    # The window of the smoothed level scale-in reads, and the share of the remaining sites'
    # throughput left spare after one goes.
    in_window_s: float = 60.0
    in_headroom: float = 0.2
    # How long a condition must hold before it acts.
    out_after_s: float = 0.0
    in_after_s: float = 0.0
    # No scale-out (scale-in) within this long of the model's last step either way.
    out_cooldown_s: float = 15.0
    in_cooldown_s: float = 120.0
    # A site's decode throughput at a full batch (tokens/s) and its prefill rate, until its
    # reports (or its same-model peers') measure them.
    site_tokens_per_s: float = 1000.0
    site_prefill_tokens_per_s: float = 10000.0
    # A scale-out whose peak the forecast says lasts no longer than this goes to idle memory on a
    # GPU already held, before a new GPU (module docstring; 0: always a new GPU).
    short_peak_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_sites <= self.max_sites or self.max_sites < 1:
            raise ValueError(f"{self.model}: need 0 <= min_sites <= max_sites, max_sites >= 1")
        if not 0 < self.scale_in_below < self.scale_out_at:
            raise ValueError(f"{self.model}: need 0 < scale_in_below < scale_out_at")
        if not 0 <= self.in_headroom < 1:
            raise ValueError(f"{self.model}: need 0 <= in_headroom < 1")
        positive = ("target_backlog_s", "rate_s", "in_window_s", "site_tokens_per_s",
                    "site_prefill_tokens_per_s")  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.model}: {name} must be > 0")
        waits = ("settle_s", "lead_time_s", "out_after_s", "in_after_s", "out_cooldown_s",
                 "in_cooldown_s", "short_peak_s")  # fmt: skip
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
    # The model's admitted work so far (gateway/sites/registry.py's Arrivals): prompt tokens
    # and predicted answer tokens, and the rates that turn them into seconds of a site's time
    # (the serving sites' measured median; None: the rule's priors).
    arrived_prompt_tokens: int = 0
    arrived_answer_tokens: int = 0
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    # How long the actuator's last start took to serve (None: none measured yet).
    start_s: float | None = None

    @property
    def serving(self) -> tuple[SiteObservation, ...]:
        return tuple(site for site in self.sites if site.serving)


@dataclass(frozen=True, slots=True)
class ModelState:
    """What the policy remembers of a model between observations."""

    flow: Flow = field(default_factory=Flow)  # arrivals and the work over time
    over_since: float | None = None  # the forecast has been over the scale-out line since
    under_since: float | None = None  # the scale-in condition has held since
    last_step_at: float | None = None  # the last scale-out or scale-in
    desired: int | None = None  # the last verdict's sites


@dataclass(frozen=True, slots=True)
class ScaleOut:
    count: int
    # How long the forecast's excess lasts (module docstring; inf: as long as the arrivals).
    peak_s: float = math.inf
    # The peak is short (peak_s <= the rule's short_peak_s): idle memory first.
    idle_memory: bool = False


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
    arrival_rate: float = 0.0  # seconds of work arriving per second (smoothed)
    lead_s: float = 0.0  # how far ahead the forecast looked
    level_s: float = 0.0  # the window's time-weighted backlog, per serving site


@dataclass(frozen=True, slots=True)
class _Seen:
    """One observation reduced to what the policy weighs."""

    serving: int
    pending: int
    work_s: float  # total, seconds of one site's time
    rate: float  # arrivals, seconds of work per second
    lead_s: float
    flow: Flow
    settled: bool = True  # the arrivals' estimate is old enough to look ahead on

    @property
    def sites(self) -> int:
        return self.serving + self.pending

    def forecast(self, sites: int) -> float:
        """The total backlog one lead time ahead with `sites` serving (while settling, arrivals
        beyond the sites' throughput are not extrapolated: the backlog now)."""
        ahead = self.lead_s if self.settled or self.rate <= sites else 0.0
        return max(0.0, self.work_s + (self.rate - sites) * ahead)

    def inputs(self) -> str:
        """What every reason says the decision was made on."""
        return (
            f"backlog {_per_site(self.work_s, self.serving):.2f}s/site, arrivals "
            f"{self.rate:.2f} site-s/s on {self.sites} site(s), lead {self.lead_s:.0f}s"
        )

    def verdict(self, desired: int, action: ScaleOut | ScaleIn | None, reason: str) -> Verdict:
        return Verdict(
            self.serving,
            self.pending,
            desired,
            _per_site(self.work_s, self.serving),
            _per_site(self.forecast(self.sites), self.sites),
            action,
            reason,
            self.rate,
            self.lead_s,
            _per_site(self.flow.level_s(), self.serving),
        )


def decide(
    rule: ScalingRule, state: ModelState, observed: ModelObservation, now: float
) -> tuple[ModelState, Verdict]:
    """The module docstring's policy: the model's new state and what to do now."""
    serving = observed.serving
    work = sum(site.work_s for site in serving)
    rates = (
        observed.prefill_tokens_per_s or rule.site_prefill_tokens_per_s,
        observed.decode_tokens_per_s or rule.site_tokens_per_s,
    )
    tokens = (observed.arrived_prompt_tokens, observed.arrived_answer_tokens)
    flow = state.flow.advance(now, work, tokens, rates, rule.rate_s, rule.in_window_s)
    lead = observed.start_s if observed.start_s is not None else rule.lead_time_s
    first = flow.first_arrival_at
    settled = first is not None and now - first >= rule.settle_s
    seen = _Seen(len(serving), observed.pending, work, flow.rate or 0.0, lead, flow, settled)
    state = replace(state, flow=flow)
    if seen.sites < rule.min_sites:
        state = _stepped(state, now)
        action = ScaleOut(rule.min_sites - seen.sites)
        return _with(state, seen.verdict(rule.min_sites, action, "below min_sites"))
    needed = _needed(rule, seen)
    if needed > seen.sites:
        return _scale_out(rule, replace(state, under_since=None), seen, needed, now)
    if not seen.settled and _needed(rule, replace(seen, settled=True)) > seen.sites:
        age = now - first if first is not None else 0.0
        reason = f"holding; arrivals settling ({age:.0f}s of {rule.settle_s:g}s; {seen.inputs()})"
        return _with(replace(state, over_since=None), seen.verdict(seen.sites, None, reason))
    return _scale_in(rule, replace(state, over_since=None), seen, serving, now)


def _needed(rule: ScalingRule, seen: _Seen) -> int:
    """The sites the forecast asks for: as many as now unless it is over the scale-out line;
    then one more, or as many as spread it under the line or absorb the arrivals with the
    headroom scale-in keeps (so that the step is not undone at once)."""
    line = rule.target_backlog_s * rule.scale_out_at
    forecast = seen.forecast(seen.sites)
    if _per_site(forecast, seen.sites) <= line:
        return seen.sites
    spread = math.ceil(forecast / line)
    absorb = math.ceil(seen.rate / (1.0 - rule.in_headroom))
    return min(rule.max_sites, max(rule.min_sites, seen.sites + 1, spread, absorb))


def _scale_out(
    rule: ScalingRule, state: ModelState, seen: _Seen, needed: int, now: float
) -> tuple[ModelState, Verdict]:
    state, held = _step_or_hold(rule, state, seen, now, out=True)
    if held is not None:
        return state, held
    line = rule.target_backlog_s * rule.scale_out_at
    peak_s = _peak_s(seen, line)
    short = rule.short_peak_s > 0 and peak_s <= rule.short_peak_s
    where = "idle memory first" if short else "a new GPU"
    peak = f"peak {peak_s:.0f}s" if math.isfinite(peak_s) else "a sustained peak"
    reason = (
        f"forecast {_per_site(seen.forecast(seen.sites), seen.sites):.2f}s/site over "
        f"{line:.2f}s ({seen.inputs()}): {needed} site(s); {peak}: {where}"
    )
    action = ScaleOut(needed - seen.sites, peak_s, short)
    return _with(state, seen.verdict(needed, action, reason))


def _step_or_hold(
    rule: ScalingRule, state: ModelState, seen: _Seen, now: float, out: bool
) -> tuple[ModelState, Verdict | None]:
    """The state stepped now (verdict None), or held with its verdict while the high (`out`) or
    low load has lasted less than its rule's wait or the last step is cooling down. Both
    directions wait alike, so that a passing burst or lull moves nothing and two steps never
    come back to back."""
    if out:
        since = state.over_since if state.over_since is not None else now
        state = replace(state, over_since=since)
        level, wait, after_s, cooldown_s = "high", "out", rule.out_after_s, rule.out_cooldown_s
    else:
        since = state.under_since if state.under_since is not None else now
        state = replace(state, under_since=since)
        level, wait, after_s, cooldown_s = "low", "in", rule.in_after_s, rule.in_cooldown_s
    if now - since < after_s:
        return _with(state, seen.verdict(seen.sites, None, f"{level}; waiting {wait}_after_s"))
    if _cooling(state, now, cooldown_s):
        return _with(state, seen.verdict(seen.sites, None, f"{level}; in cooldown"))
    return _stepped(state, now), None


def _peak_s(seen: _Seen, line: float) -> float:
    """How long the excess over the line lasts without the new site (module docstring)."""
    if seen.sites == 0 or seen.rate >= seen.sites:
        return math.inf
    return max(0.0, seen.work_s - line * seen.sites) / (seen.sites - seen.rate)


def _scale_in(
    rule: ScalingRule,
    state: ModelState,
    seen: _Seen,
    serving: tuple[SiteObservation, ...],
    now: float,
) -> tuple[ModelState, Verdict]:
    fewer = seen.serving - 1
    victim = _victim(serving)
    if seen.pending or seen.serving <= rule.min_sites or victim is None:
        return _with(replace(state, under_since=None), seen.verdict(seen.sites, None, "holding"))
    why_not = _why_not_fewer(rule, seen, fewer)
    if why_not is not None:
        return _with(replace(state, under_since=None), seen.verdict(seen.sites, None, why_not))
    state, held = _step_or_hold(rule, state, seen, now, out=False)
    if held is not None:
        return state, held
    reason = (
        f"{rule.in_window_s:g}s mean with {fewer} site(s): backlog "
        f"{_per_site(seen.flow.level_s(), fewer):.2f}s/site, load "
        f"{_load(seen, max(fewer, 1)):.2f} ({seen.inputs()}); {victim.name} holds the least cache "
        f"({victim.cache_blocks} blocks)"
    )
    return _with(state, seen.verdict(seen.serving - 1, ScaleIn(victim.name), reason))


def _why_not_fewer(rule: ScalingRule, seen: _Seen, fewer: int) -> str | None:
    """Why one site fewer would not do (None: it would)."""
    if seen.flow.span_s < rule.in_window_s:
        return "holding; smoothing window not full"
    in_line = rule.target_backlog_s * rule.scale_in_below
    out_line = rule.target_backlog_s * rule.scale_out_at
    if fewer == 0:  # to zero only when nothing is there or arriving
        idle = seen.flow.level_s() == 0.0 and seen.work_s == 0.0
        return None if idle and seen.flow.window_rate() == 0.0 else "holding; not idle"
    if seen.flow.level_s() / fewer >= in_line:
        return "holding; smoothed backlog over the scale-in line"
    if _load(seen, fewer) > 1.0 - rule.in_headroom:
        return "holding; arrivals need the site"
    if seen.forecast(fewer) / fewer > out_line:
        return "holding; one site fewer would scale out again"
    return None


def _load(seen: _Seen, sites: int) -> float:
    """The share of `sites`' throughput the arrivals take (the window's mean or the smoothed
    rate now, whichever is higher: a load rising at the window's end counts)."""
    return max(seen.flow.window_rate(), seen.rate) / sites


def _stepped(state: ModelState, now: float) -> ModelState:
    return replace(
        state,
        last_step_at=now,
        over_since=None,
        under_since=None,
        flow=state.flow.restart_window(),
    )


def _per_site(total: float, sites: int) -> float:
    if sites > 0:
        return total / sites
    return math.inf if total > 0 else 0.0


def _with(state: ModelState, verdict: Verdict) -> tuple[ModelState, Verdict]:
    return replace(state, desired=verdict.desired), verdict


def _cooling(state: ModelState, now: float, cooldown_s: float) -> bool:
    return state.last_step_at is not None and now - state.last_step_at < cooldown_s


def _victim(serving: tuple[SiteObservation, ...]) -> SiteObservation | None:
    """The removable site whose cache is worth least, then with the least work, then newest."""
    removable = [site for site in serving if site.removable]
    if not removable:
        return None
    return min(removable, key=lambda s: (s.cache_blocks, s.work_s, -s.joined_at, s.name))
