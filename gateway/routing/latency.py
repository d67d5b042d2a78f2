"""Latency-aware routing: each site's predicted time to first token and to completion, and the
two estimators that feed it from what the gateway already sees (no new site protocol).

The model is BlockLLM's split of a request's latency on a candidate (T_transfer + T_queue +
T_compute), written for an iteration-level engine. For a request with prompt P and planned
answer A on a site with S batch slots, n requests present (running + queued), R their mean
remaining answer, measured round trip rtt and step time t(b) at batch b:

- T_transfer = rtt: the request travels one way and the first token comes back the other (the
  last token likewise, so completion pays the same round trip once).
- T_queue: with n < S the request joins the running batch at once. Otherwise it waits for
  k = n + 1 - S sequences to finish; in a full batch a sequence finishes every R * t(S) / S
  seconds on average (S sequences, each with R steps left), so T_queue = k * R * t(S) / S.
- T_compute: the prompt in ceil(P / prefill_chunk) steps (chunked prefill), then A - 1 decode
  steps, each at the batch it joins, b' = min(S, n + 1): a bigger batch is a slower step.

TTFT = T_transfer + T_queue + prefill; completion = TTFT + (A - 1) * t(b'). The scorer ranks
sites by predicted completion: a fast far site beats a slow near one only when the difference in
compute outweighs the difference in round trip. The KV bound is a filter of its own
(KvBoundFilter), as for `mico`.

Step time comes from the load reports: a step emits one token per running sequence, so
t(b) = running / decode tokens per second. `StepTimeModel` fits t(b) = base + per_sequence * b
to those observations by exponentially weighted least squares (recent reports count more), so a
site that slows down (a noisy neighbour, a throttled VM) is seen within a few reports. Round
trip comes from the health checks: `RttEstimator` keeps the minimum of the last few check
durations, which filters out the time a busy site takes to answer (that part is queueing, which
T_queue already counts).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from gateway.routing.types import RoutableSite, RoutingRequest, SiteLatency, StepTime

# Reports older than this many report intervals weigh less than 1/e.
_STEP_MEMORY = 20.0
# A site that never reported decoding is assumed to step this fast until it does.
_PRIOR_STEP = StepTime(0.02)
# Batch sizes closer than this (in variance) are one batch size: no slope can be fitted.
_FLAT = 1e-6


@dataclass(slots=True)
class RttEstimator:
    """Contract: `value` is the smallest of the last `window` observed round trips (seconds),
    None before the first; observations < 0 raise ValueError."""

    window: int = 8
    _samples: deque[float] = field(default_factory=deque)
    _min: float | None = None  # kept at each observation: routing reads it per site per decision

    def observe(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a round trip cannot be negative, got {seconds}")
        self._samples.append(seconds)
        while len(self._samples) > self.window:
            self._samples.popleft()
        self._min = min(self._samples)

    @property
    def value(self) -> float | None:
        return self._min


@dataclass(slots=True)
class StepTimeModel:
    """Contract: `observe(running, decode_tokens_per_s)` takes one load report; reports of an
    idle site (running or rate <= 0) teach nothing and are ignored. `fit()` is None before the
    first useful report; otherwise the weighted least-squares line through the observed
    (batch, running / rate) points, each older report weighing exp(-1/_STEP_MEMORY) less; the
    slope is never negative (a bigger batch is never faster per step) and the base never below
    zero. With one batch size seen, the line is flat at the weighted mean step time.
    The line is fitted once per useful report, not per `fit()` call (routing reads it for every
    site at every decision); `observations` counts those reports (it changes when the line may
    have)."""

    _w: float = 0.0
    _b: float = 0.0
    _t: float = 0.0
    _bb: float = 0.0
    _bt: float = 0.0
    _line: StepTime | None = None
    observations: int = 0

    def observe(self, running: int, decode_tokens_per_s: float) -> None:
        if running <= 0 or decode_tokens_per_s <= 0:
            return
        self.observations += 1
        step = running / decode_tokens_per_s
        keep = math.exp(-1.0 / _STEP_MEMORY)
        self._w = keep * self._w + 1.0
        self._b = keep * self._b + running
        self._t = keep * self._t + step
        self._bb = keep * self._bb + running * running
        self._bt = keep * self._bt + running * step
        self._line = self._fit()

    def fit(self) -> StepTime | None:
        return self._line

    def _fit(self) -> StepTime | None:
        if self._w == 0.0:
            return None
        mean_b, mean_t = self._b / self._w, self._t / self._w
        variance = self._bb / self._w - mean_b * mean_b
        if variance <= _FLAT * max(1.0, mean_b * mean_b):
            return StepTime(mean_t, 0.0)
        slope = max(0.0, (self._bt / self._w - mean_b * mean_t) / variance)
        base = mean_t - slope * mean_b
        if base < 0.0:  # the line would give a free step at batch 0: keep it through the mean
            return StepTime(0.0, mean_t / mean_b)
        return StepTime(base, slope)


@dataclass(slots=True)
class RateEstimate:
    """Contract: `observe(rate)` takes one reported rate; a rate <= 0 (the report's window held
    no such work) teaches nothing and is ignored. `value` is None before the first useful
    report, else the mean of those observed, each older one weighing exp(-1/_STEP_MEMORY) less
    (as StepTimeModel weighs its reports)."""

    _w: float = 0.0
    _sum: float = 0.0
    _value: float | None = None  # kept at each observation: routing reads it per site
    observations: int = 0

    def observe(self, rate: float) -> None:
        if rate <= 0:
            return
        keep = math.exp(-1.0 / _STEP_MEMORY)
        self._w = keep * self._w + 1.0
        self._sum = keep * self._sum + rate
        self._value = self._sum / self._w
        self.observations += 1

    @property
    def value(self) -> float | None:
        return self._value


@dataclass(frozen=True, slots=True)
class PredictedLatency:
    ttft_s: float
    completion_s: float


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """The module docstring's model. prior_step: the step time assumed for a site that never
    reported decoding (it is tried, then measured); prefill_chunk_tokens: the engines' token
    budget per step (site --max-num-batched-tokens); batch slots unknown: one request at a
    time is assumed not to queue (no slot bound)."""

    prior_step: StepTime = _PRIOR_STEP
    prefill_chunk_tokens: int = 2048

    def predict(self, request: RoutingRequest, site: SiteLatency) -> PredictedLatency:
        """Contract: TTFT and completion time (seconds) of `request` on `site`, as the module
        docstring defines them; completion >= TTFT >= rtt (unmeasured rtt counts 0)."""
        step = site.step or self.prior_step
        slots = site.batch_slots
        present = max(site.requests, 0)
        answer = max(request.answer_tokens, 1)
        queue_s = 0.0
        joins = present + 1
        if site.full and slots is not None:
            mean_remaining = site.remaining_answer_tokens / present
            queue_s = (present + 1 - slots) * mean_remaining * step.at(slots) / slots
            joins = slots
        step_s = step.at(joins)
        prefill_steps = max(1, math.ceil(request.prompt_tokens / self.prefill_chunk_tokens))
        ttft = (site.rtt_s or 0.0) + queue_s + prefill_steps * step_s
        return PredictedLatency(ttft, ttft + (answer - 1) * step_s)


@dataclass(frozen=True, slots=True)
class PredictedCompletionCost:
    """Contract: the request's predicted completion time on the site in seconds (LatencyModel),
    lower is better; reads only site.latency and the request."""

    model: LatencyModel = LatencyModel()
    name: str = "least_latency"

    def cost(self, request: RoutingRequest, site: RoutableSite) -> float:
        return self.model.predict(request, site.latency).completion_s
