"""What one run measured, and the comparisons the tables report. Pure arithmetic, no I/O.

Time has two units. Iterations: a run's makespan is the largest number of engine iterations
any site ran for it (sites step in parallel in a real federation, so the busiest one decides
when the last query is done): MICO's unit, and here the primary one, because it does not depend
on how the processes share this machine's cores. Wall clock: from the first submission to the
last answer, through the real gateway; secondary, because all sites share the same few cores
(a site's step takes longer the more sites are busy) and other work on the machine adds noise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bench.multisite.counters import SiteCounters
from bench.multisite.replay import Outcome


@dataclass(frozen=True, slots=True)
class Config:
    """One of MICO's four configurations: a routing policy at the gateway and a scheduling
    policy in the site engines."""

    key: str
    label: str
    routing_policy: str  # gateway: round_robin or mico
    engine_policy: str  # site: static (batch by batch) or fcfs (iteration-level)


RR_STATIC = Config("rr_static", "round robin + static", "round_robin", "static")
RR_ITER = Config("rr_iter", "round robin + iteration", "round_robin", "fcfs")
TOK_STATIC = Config("tok_static", "token-balanced + static", "mico", "static")
MICO = Config("mico", "token-balanced + iteration (MICO)", "mico", "fcfs")
CONFIGS: tuple[Config, ...] = (RR_STATIC, RR_ITER, TOK_STATIC, MICO)
BASELINE = RR_STATIC.key


@dataclass(frozen=True, slots=True)
class RunResult:
    config: str
    sites: int
    max_batch: int
    queries: int
    completed: int
    failed: int
    wall_s: float
    # Per site (every site of the run, idle ones included): engine iterations, KV use summed
    # over iterations (tokens cached, blocks held), tokens served (prompt + completion), queries.
    iterations: Mapping[str, int]
    kv_token_iterations: Mapping[str, int]
    kv_block_iterations: Mapping[str, int]
    tokens_served: Mapping[str, int]
    queries_served: Mapping[str, int]
    completion_tokens: int
    errors: tuple[str, ...] = ()
    extra: Mapping[str, object] = field(default_factory=dict)

    @property
    def makespan_iterations(self) -> int:
        return max(self.iterations.values(), default=0)

    @property
    def total_iterations(self) -> int:
        return sum(self.iterations.values())

    @property
    def kv_tokens(self) -> int:
        return sum(self.kv_token_iterations.values())

    @property
    def imbalance(self) -> float:
        return imbalance(self.tokens_served.values())

    def summary(self) -> dict[str, object]:
        return {
            "config": self.config,
            "sites": self.sites,
            "max_batch": self.max_batch,
            "queries": self.queries,
            "completed": self.completed,
            "failed": self.failed,
            "wall_s": round(self.wall_s, 3),
            "makespan_iterations": self.makespan_iterations,
            "total_iterations": self.total_iterations,
            "kv_token_iterations": self.kv_tokens,
            "kv_block_iterations": sum(self.kv_block_iterations.values()),
            "imbalance": round(self.imbalance, 4),
            "completion_tokens": self.completion_tokens,
            "queries_per_kilo_iteration": round(
                1000 * self.completed / max(self.makespan_iterations, 1), 4
            ),
            "queries_per_s": round(self.completed / self.wall_s, 4) if self.wall_s else 0.0,
            "per_site": {
                name: {
                    "iterations": self.iterations[name],
                    "kv_token_iterations": self.kv_token_iterations[name],
                    "tokens_served": self.tokens_served.get(name, 0),
                    "queries_served": self.queries_served.get(name, 0),
                }
                for name in sorted(self.iterations)
            },
            "errors": list(self.errors[:5]),
            **self.extra,
        }


def imbalance(per_site: Iterable[int]) -> float:
    """max / mean of the per-site amounts (1.0 is perfectly even); 0.0 when nothing was served."""
    values = list(per_site)
    if not values or sum(values) == 0:
        return 0.0
    return max(values) / (sum(values) / len(values))


def build_run(
    config: str,
    *,
    max_batch: int,
    outcomes: Sequence[Outcome],
    wall_s: float,
    counters: Mapping[str, SiteCounters],
    extra: Mapping[str, object] | None = None,
) -> RunResult:
    """A run from its HTTP outcomes and the sites' counter differences (name -> delta)."""
    tokens: dict[str, int] = dict.fromkeys(counters, 0)
    served: dict[str, int] = dict.fromkeys(counters, 0)
    for outcome in outcomes:
        if outcome.ok and outcome.site is not None:
            tokens[outcome.site] = tokens.get(outcome.site, 0) + outcome.tokens
            served[outcome.site] = served.get(outcome.site, 0) + 1
    completed = sum(o.ok for o in outcomes)
    return RunResult(
        config=config,
        sites=len(counters),
        max_batch=max_batch,
        queries=len(outcomes),
        completed=completed,
        failed=len(outcomes) - completed,
        wall_s=wall_s,
        iterations={n: c.iterations for n, c in counters.items()},
        kv_token_iterations={n: c.kv_token_iterations for n, c in counters.items()},
        kv_block_iterations={n: c.kv_block_iterations for n, c in counters.items()},
        tokens_served=tokens,
        queries_served=served,
        completion_tokens=sum(o.completion_tokens for o in outcomes if o.ok),
        errors=tuple(sorted({o.error or f"HTTP {o.status}" for o in outcomes if not o.ok})),
        extra=dict(extra or {}),
    )


def ratio(baseline: float, value: float) -> float:
    """baseline / value, e.g. a speed-up from makespans; 0.0 when value is 0."""
    return baseline / value if value else 0.0


def reduction(baseline: float, value: float) -> float:
    """1 - value / baseline: the share saved; 0.0 when the baseline is 0."""
    return 1 - value / baseline if baseline else 0.0


@dataclass(frozen=True, slots=True)
class Cell:
    """The four configurations at one (sites, max batch, queries) point."""

    sites: int
    max_batch: int
    queries: int
    runs: Mapping[str, RunResult]

    def speedup(self, key: str) -> float:
        """The baseline's makespan in iterations over `key`'s (higher is better)."""
        return ratio(self.runs[BASELINE].makespan_iterations, self.runs[key].makespan_iterations)

    def speedup_wall(self, key: str) -> float:
        return ratio(self.runs[BASELINE].wall_s, self.runs[key].wall_s)

    def kv_cut(self, key: str) -> float:
        return reduction(self.runs[BASELINE].kv_tokens, self.runs[key].kv_tokens)

    def row(self) -> dict[str, object]:
        """The results-file entry: ratios against round robin + static batching."""
        others = [k for k in self.runs if k != BASELINE]
        return {
            "sites": self.sites,
            "max_batch": self.max_batch,
            "queries": self.queries,
            "ratio_vs_rr_static": {k: round(self.speedup(k), 4) for k in others},
            "ratio_vs_rr_static_wall": {k: round(self.speedup_wall(k), 4) for k in others},
            "kv_cumulative_reduction": {k: round(self.kv_cut(k), 4) for k in others},
            "imbalance": {k: round(r.imbalance, 4) for k, r in self.runs.items()},
            "makespan_iterations": {k: r.makespan_iterations for k, r in self.runs.items()},
            "wall_s": {k: round(r.wall_s, 2) for k, r in self.runs.items()},
            "completed": {k: r.completed for k, r in self.runs.items()},
            "runs": [r.summary() for r in self.runs.values()],
        }


def overall_kv_reduction(cells: Sequence[Cell], key: str) -> float:
    """1 - sum of `key`'s cumulative KV over sum of the baseline's, across all cells."""
    base = sum(c.runs[BASELINE].kv_tokens for c in cells if key in c.runs)
    value = sum(c.runs[key].kv_tokens for c in cells if key in c.runs)
    return reduction(base, value)
