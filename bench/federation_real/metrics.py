"""One arm's figures from its requests, computed the same way for the real run and the simulated
one, so the two differ only in what happened.

- goodput_rps: requests that finished with TTFT <= the SLO's TTFT and TPOT <= its TPOT, over the
  arrival window (DistServe's per-request goodput at a fixed offered load: one real run per
  arm, no bisection on the rate); slo_attainment: their share of all requests.
- ttft / tpot p50 and p99 over the requests that finished (TPOT over those of two tokens or
  more); `slo_p99_met`: every request finished and both p99s within the SLO (fedsim.study's rule
  at this one rate).
- prefix hits: prompt tokens found in the sites' prefix caches over those looked up.
- per site: the requests it finished (the real run's own: arms.py, from the gateway's counters).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.serving_path.clients import Sent
from fedsim.federation import RequestOutcome, Slo, percentile


@dataclass(frozen=True, slots=True)
class Served:
    request_id: str
    site: str | None
    completed: bool
    ttft_s: float | None
    tpot_s: float | None  # None for an answer of one token
    answer_tokens: int

    @classmethod
    def of_sent(cls, request_id: str, sent: Sent | None) -> Served:
        """A request of bench/serving_path/clients.py's open loop (None: never sent). Its site
        is the one its answer's X-Fedllm-Site header names: where routing first sent it (the
        bench counts the sites that ended requests from the gateway's counters)."""
        if sent is None:
            return cls(request_id, None, False, None, None, 0)
        answer = sent.answer
        first = answer.first_s
        ttft = first - sent.sent_s if first is not None else None
        tpot = None
        if answer.complete and first is not None and answer.end_s is not None and answer.tokens > 1:
            tpot = (answer.end_s - first) / (answer.tokens - 1)
        return cls(request_id, answer.site, answer.complete, ttft, tpot, answer.tokens)

    @classmethod
    def of_sim(cls, outcome: RequestOutcome) -> Served:
        tpot = outcome.tpot_s if outcome.completed and outcome.produced > 1 else None
        return cls(
            outcome.request_id,
            outcome.site or None,
            outcome.completed,
            outcome.ttft_s,
            tpot,
            outcome.produced,
        )

    def meets(self, slo: Slo) -> bool:
        if not self.completed or self.ttft_s is None or self.ttft_s > slo.ttft_p99_s:
            return False
        return self.tpot_s is None or self.tpot_s <= slo.tpot_p99_s


def summary(
    served: Sequence[Served],
    slo: Slo,
    window_s: float,
    prefix_queries: Mapping[str, float],
    prefix_hits: Mapping[str, float],
) -> dict[str, object]:
    """The module docstring's figures of one arm."""
    done = [s for s in served if s.completed and s.ttft_s is not None]
    ttft = [s.ttft_s for s in done if s.ttft_s is not None]
    tpot = [s.tpot_s for s in done if s.tpot_s is not None]
    good = sum(s.meets(slo) for s in served)
    queries, hits = sum(prefix_queries.values()), sum(prefix_hits.values())
    out: dict[str, object] = {
        "requests": len(served),
        "completed": len(done),
        "goodput_rps": good / window_s,
        "slo_attainment": good / max(len(served), 1),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p99_s": percentile(tpot, 0.99),
        "prefix_hit_tokens": hits,
        "prefix_query_tokens": queries,
        "prefix_hit_share": hits / queries if queries else 0.0,
        "by_site": dict(sorted(Counter(s.site or "-" for s in done).items())),
    }
    out["slo_p99_met"] = (
        len(done) == len(served)
        and percentile(ttft, 0.99) <= slo.ttft_p99_s
        and percentile(tpot, 0.99) <= slo.tpot_p99_s
    )
    return out
