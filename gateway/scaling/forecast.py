"""What the scaling policy (gateway/scaling/policy.py) derives from a model's observations over
time: the rate predicted work arrives at, and the time-weighted level of the work over a window.

Work is in seconds of one site's time (gateway/scaling/observe.py): an arrival of P prompt
tokens and A predicted answer tokens is P / prefill rate + A / full-batch decode throughput, at
the rates the sites measure now. A serving site does one second of such work per second when
it is busy, so `rate / serving sites` is the utilisation the arrivals ask for.

The arrivals are smoothed as tokens per second (prompt and answer apart) and priced at the
rates of the latest observation: a rate is what the sites can do, the tokens are what comes. A
smoothed rate of seconds priced tick by tick kept the price of each past tick: arrivals priced at
the rule's priors (or at a site's first, cold measurements) while the sites were not measured
yet weighed in it until they decayed, where the tokens repriced at once cost what the sites now
measure (the predictive policy's seed 1 scaled out 3.8 s into 1x load on such a rate: 1.64
site-s/s, against 0.33 for the same load at the end of the run; docs/elastic.md).

Pure arithmetic on the policy's state: no clock of its own, tested through the policy on a fake
clock (tests/unit/scaling/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    work_s: float  # the serving sites' total work then
    arrived_s: float  # the work arrived since the policy's start, cumulative


@dataclass(frozen=True, slots=True)
class Flow:
    """The arrivals and the work over time, as far as the policy remembers them."""

    prompt_tokens: int | None = None  # the model's admitted-token counters last observed
    answer_tokens: int | None = None
    at: float | None = None
    arrived_s: float = 0.0  # work arrived since the policy's start (seconds of a site's time)
    rate: float | None = None  # arrivals, smoothed: seconds of work per second (priced now)
    # The arrivals smoothed in tokens per second (prompt, answer): what `rate` prices.
    token_rates: tuple[float, float] | None = None
    # When the first work arrived (the estimate's age: policy.py's settling).
    first_arrival_at: float | None = None
    # The window of the smoothed level: samples since the model's last scaling step (a level
    # measured with another number of sites says nothing of this one), oldest first.
    samples: tuple[Sample, ...] = ()

    def advance(
        self,
        now: float,
        work_s: float,
        tokens: tuple[int, int],
        rates: tuple[float, float],
        smooth_s: float,
        window_s: float,
    ) -> Flow:
        """The flow with this observation: `tokens` the admitted (prompt, answer) counters,
        `rates` the (prefill, decode) tokens per second that turn them into work."""
        prompt, answer = tokens
        if self.at is None or self.prompt_tokens is None or self.answer_tokens is None:
            # The first observation: counters start here; no rate yet.
            return Flow(prompt, answer, now, 0.0, None, samples=(Sample(now, work_s, 0.0),))
        if now <= self.at:
            return self
        dt = now - self.at
        # A counter that went back (a gateway restart behind the same state) counts from zero.
        new_prompt = prompt - self.prompt_tokens if prompt >= self.prompt_tokens else prompt
        new_answer = answer - self.answer_tokens if answer >= self.answer_tokens else answer
        arrived = new_prompt / rates[0] + new_answer / rates[1]
        instant = (new_prompt / dt, new_answer / dt)
        if self.token_rates is None:
            smoothed = instant
        else:
            weight = 1.0 - math.exp(-dt / smooth_s)
            smoothed = (
                self.token_rates[0] + weight * (instant[0] - self.token_rates[0]),
                self.token_rates[1] + weight * (instant[1] - self.token_rates[1]),
            )
        rate = smoothed[0] / rates[0] + smoothed[1] / rates[1]
        first = self.first_arrival_at
        if first is None and (new_prompt or new_answer):
            first = now
        total = self.arrived_s + arrived
        kept = _trim((*self.samples, Sample(now, work_s, total)), now - window_s)
        return Flow(prompt, answer, now, total, rate, smoothed, first, kept)

    def restart_window(self) -> Flow:
        """A scaling step: the level is measured anew from the last sample on."""
        return replace(self, samples=self.samples[-1:])

    @property
    def span_s(self) -> float:
        """How long the window's samples cover."""
        return self.samples[-1].at - self.samples[0].at if len(self.samples) > 1 else 0.0

    def level_s(self) -> float:
        """The work's time-weighted mean over the window (each sample held until the next)."""
        if len(self.samples) < 2:
            return self.samples[-1].work_s if self.samples else 0.0
        pairs = zip(self.samples, self.samples[1:], strict=False)
        held = sum(a.work_s * (b.at - a.at) for a, b in pairs)
        return held / self.span_s

    def window_rate(self) -> float:
        """The arrivals' mean rate over the window (work arrived in it over its length)."""
        if self.span_s <= 0:
            return self.rate or 0.0
        return (self.samples[-1].arrived_s - self.samples[0].arrived_s) / self.span_s


def _trim(samples: tuple[Sample, ...], since: float) -> tuple[Sample, ...]:
    """The samples from `since` on, with the last one before it kept as the window's start (the
    mean then covers the whole window, not only what follows its first sample)."""
    first = 0
    for i, sample in enumerate(samples):
        if sample.at <= since:
            first = i
    return samples[first:]
