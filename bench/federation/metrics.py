"""What one (policy, rate) run measured, and goodput at the SLO.

SLO (issue 21): TTFT p99 <= 2 s and TPOT p99 <= 100 ms, measured at the client, the network
to the sites included. Two goodputs, both reported:

- `goodput_rps` of a policy: the highest swept rate at which the run holds the SLO's p99s with
  every request answered or still streaming when the drain ended (one cut off while streaming
  counts with its TTFT and its TPOT until the cut, bench/federation/loadgen.py; one failed, or
  cut off before its first token, counts as missing both), every lower rate holding them too.
  A fixed drain would otherwise fail a 1,024-token answer sent near the end of the arrivals at
  a TPOT well inside the SLO, and rank policies by how fast long answers end, not by the SLO.
  This is the headline, and `goodput_vs_least_requests` is its ratio. On a
  discrete sweep it moves in steps.
- `slo_attained_rps` of a run: the requests that met both bounds themselves, per second of
  arrivals (DistServe's per-request goodput); its best over the sweep is reported next to it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.federation.loadgen import Outcome, RunOutcomes

TTFT_SLO_S = 2.0
TPOT_SLO_S = 0.100
# Requests listed per run by how late their first token came (a run's p99 is one or two of them).
SLOWEST_SHOWN = 5


def percentile(values: Sequence[float], share: float) -> float:
    """Nearest-rank percentile; inf for an empty list (nothing answered: the SLO is missed)."""
    if not values:
        return math.inf
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def _with_misses(values: list[float], misses: int) -> list[float]:
    """A request that never answered is slower than any that did."""
    return values + [math.inf] * misses


@dataclass(frozen=True, slots=True)
class RunSummary:
    arm: str
    rate_rps: float
    duration_s: float
    requests: int
    completed: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    slo_attained_rps: float
    output_tokens_per_s: float
    tokens_per_site: Mapping[str, int]
    requests_per_site: Mapping[str, int]
    errors: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    cut_off_streaming: int = 0  # of the requests not completed
    # The requests with the latest first tokens (where a p99 comes from: one or two of them).
    slowest: tuple[Mapping[str, Any], ...] = ()

    @property
    def holds_slo(self) -> bool:
        return (
            self.completed + self.cut_off_streaming == self.requests
            and self.ttft_p99_s <= TTFT_SLO_S
            and self.tpot_p99_s <= TPOT_SLO_S
        )

    def to_json(self) -> dict[str, Any]:
        def num(value: float) -> float | None:
            return round(value, 4) if math.isfinite(value) else None

        return {
            "arm": self.arm,
            "rate_rps": self.rate_rps,
            "duration_s": self.duration_s,
            "requests": self.requests,
            "completed": self.completed,
            "cut_off_streaming": self.cut_off_streaming,
            "holds_slo": self.holds_slo,
            "ttft_s": {
                "p50": num(self.ttft_p50_s),
                "p90": num(self.ttft_p90_s),
                "p99": num(self.ttft_p99_s),
            },
            "e2e_s": {"p50": num(self.e2e_p50_s), "p99": num(self.e2e_p99_s)},
            "tpot_s": {"p50": num(self.tpot_p50_s), "p99": num(self.tpot_p99_s)},
            "slo_attained_rps": round(self.slo_attained_rps, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 1),
            "tokens_per_site": dict(self.tokens_per_site),
            "requests_per_site": dict(self.requests_per_site),
            "errors": list(self.errors[:5]),
            "slowest_first_tokens": list(self.slowest),
            **dict(self.extra),
        }


def _meets(outcome: Outcome) -> bool:
    tpot = outcome.tpot_s
    return (
        (outcome.ok or outcome.cut_off_streaming)
        and outcome.ttft_s is not None
        and outcome.ttft_s <= TTFT_SLO_S
        and tpot is not None
        and tpot <= TPOT_SLO_S
    )


def slowest_first_tokens(outcomes: Sequence[Outcome], count: int) -> tuple[dict[str, Any], ...]:
    """The `count` requests whose first token came last (none at all first): where each went,
    when it was sent, its prompt and answer, its TTFT (None: never came) and how it ended."""

    def ttft(outcome: Outcome) -> float:
        return math.inf if outcome.ttft_s is None else outcome.ttft_s

    ranked = sorted(outcomes, key=ttft, reverse=True)[:count]
    return tuple(
        {
            "id": o.id,
            "site": o.site,
            "sent_s": round(o.sent_s, 3),
            "prompt_tokens": o.prompt_tokens,
            "answer_tokens": o.answer_tokens,
            "ttft_s": None if o.ttft_s is None else round(o.ttft_s, 3),
            "ended": "ok" if o.ok else (o.error or f"HTTP {o.status}")[:80],
        }
        for o in ranked
    )


def summarize(
    arm: str, rate_rps: float, duration_s: float, run: RunOutcomes, **extra: Any
) -> RunSummary:
    outcomes = run.outcomes
    done = [o for o in outcomes if o.ok]
    judged = [o for o in outcomes if o.ok or o.cut_off_streaming]
    misses = len(outcomes) - len(judged)
    ttft = _with_misses([o.ttft_s for o in judged if o.ttft_s is not None], misses)
    e2e = _with_misses([o.e2e_s for o in done if o.e2e_s is not None], len(outcomes) - len(done))
    tpot = _with_misses([t for o in judged if (t := o.tpot_s) is not None], misses)
    tokens: dict[str, int] = {}
    served: dict[str, int] = {}
    for outcome in done:
        site = outcome.site or "?"
        tokens[site] = tokens.get(site, 0) + outcome.prompt_tokens + outcome.completion_tokens
        served[site] = served.get(site, 0) + 1
    output = sum(o.completion_tokens for o in done)
    return RunSummary(
        arm=arm,
        rate_rps=rate_rps,
        duration_s=duration_s,
        requests=len(outcomes),
        completed=len(done),
        ttft_p50_s=percentile(ttft, 0.5),
        ttft_p90_s=percentile(ttft, 0.9),
        ttft_p99_s=percentile(ttft, 0.99),
        e2e_p50_s=percentile(e2e, 0.5),
        e2e_p99_s=percentile(e2e, 0.99),
        tpot_p50_s=percentile(tpot, 0.5),
        tpot_p99_s=percentile(tpot, 0.99),
        slo_attained_rps=sum(_meets(o) for o in outcomes) / duration_s,
        output_tokens_per_s=output / run.wall_s if run.wall_s > 0 else 0.0,
        tokens_per_site=dict(sorted(tokens.items())),
        requests_per_site=dict(sorted(served.items())),
        errors=tuple(o.error for o in outcomes if o.error),
        extra=extra,
        cut_off_streaming=sum(o.cut_off_streaming for o in outcomes),
        slowest=slowest_first_tokens(outcomes, SLOWEST_SHOWN),
    )


def goodput_rps(points: Sequence[tuple[float, bool]]) -> float:
    """(rate, held the SLO) pairs -> the highest swept rate that holds the SLO, every lower swept
    rate holding it too (0 when the lowest misses). A rate that holds above one that missed is
    noise, not capacity: it does not count."""
    best = 0.0
    for rate, holds in sorted(points):
        if not holds:
            break
        best = rate
    return best


def ratio(value: float, baseline: float) -> float | None:
    """value / baseline; None when the baseline is 0 (no ratio to report)."""
    return round(value / baseline, 3) if baseline > 0 else None


def tokens_per_capacity(
    tokens_per_site: Sequence[Mapping[str, int]], weights: Mapping[str, float]
) -> dict[str, float]:
    """Tokens a site served over the given runs, per unit of its capacity weight, as a share of
    the mean over sites (1.0 everywhere: every site got its share of the work)."""
    totals = {name: sum(run.get(name, 0) for run in tokens_per_site) for name in weights}
    per_capacity = {name: totals[name] / weights[name] for name in weights}
    mean = sum(per_capacity.values()) / len(per_capacity) if per_capacity else 0.0
    return {name: round(v / mean, 3) if mean > 0 else 0.0 for name, v in per_capacity.items()}
