"""Open-loop serving: Poisson arrivals at a sweep of rates, and the goodput they give.

Open loop means requests arrive on their own clock (a Poisson process), whether or not the
engine keeps up: latency then shows queueing, which a closed loop (a fixed number of clients)
hides. Each rate runs `duration_s` seconds of arrivals through one warmed-up engine (the same
engine for every rate of a sweep: no capture or compilation inside a measurement), and is
given `drain_s` more seconds to finish; requests still unfinished then count against the SLO.

The goodput is the highest swept rate that holds the SLO (TTFT p99 <= 1 s and TPOT p99 <=
50 ms by default, every request finished), with every lower swept rate holding it too; a sweep
stops after `stop_after_failures` consecutive rates that miss the SLO.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.engine.engine_runs import measure_run
from bench.engine.harness import Progress
from bench.engine.metrics import RunSummary
from fedsim.engine_trace import WorkloadRequest, poisson_arrivals
from site_engine.engine.core.types import FinishReason
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_p99_ms: float = 1000.0
    tpot_p99_ms: float = 50.0


def misses(summary: RunSummary, slo: Slo) -> list[str]:
    """Why a run misses the SLO (empty when it holds)."""
    reasons = []
    if summary.completed < summary.requests or summary.truncated or summary.rejected:
        reasons.append(f"{summary.requests - summary.completed} request(s) unfinished")
    if summary.ttft is None or summary.ttft.p99_ms > slo.ttft_p99_ms:
        reasons.append("TTFT p99 over the limit")
    if summary.tpot is None or summary.tpot.p99_ms > slo.tpot_p99_ms:
        reasons.append("TPOT p99 over the limit")
    return reasons


def goodput(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The row of the highest rate that holds the SLO with every lower rate holding it too
    (rows: {"rate_rps", "meets_slo", ...}); None if the lowest rate already misses it."""
    best = None
    for row in sorted(rows, key=lambda r: float(r["rate_rps"])):
        if not row["meets_slo"]:
            break
        best = row
    return best


def drain_engine(engine: PagedEngine, request_ids: Sequence[str]) -> None:
    """Cancel what a truncated run left, so the next rate starts on an idle engine."""
    for request_id in request_ids:
        engine.abort(request_id, FinishReason.CANCELLED)
    while engine.has_unfinished():
        engine.step()


def run_rate(
    engine: PagedEngine,
    loaded: LoadedModel,
    config: EngineConfig,
    make_requests: Callable[[int, int], list[WorkloadRequest]],
    *,
    mix: str,
    rate: float,
    duration_s: float,
    drain_s: float,
    seed: int,
    slo: Slo,
    log: Progress,
) -> dict[str, Any]:
    """One rate: `rate * duration_s` requests with Poisson arrival times, through `engine`."""
    count = max(1, round(rate * duration_s))
    rate_seed = seed * 1000 + round(rate * 10)
    requests = make_requests(count, rate_seed)
    arrivals = poisson_arrivals(count, rate, rate_seed)
    summary, extra = measure_run(
        engine,
        loaded,
        requests,
        config,
        name=f"{mix}@{rate:g}",
        arrivals=arrivals,
        poisson_rate=rate,
        budget_s=arrivals[-1] + drain_s,
        log=log,
        sample_queue=True,
    )
    drain_engine(engine, [r.request_id for r in requests])
    missed = misses(summary, slo)
    row = {
        "mix": mix,
        "rate_rps": rate,
        "meets_slo": not missed,
        "misses": missed,
        "output_tok_s": summary.output_tok_s,
        # What the arrivals asked for per second: output_tok_s counts the drain after the last
        # arrival too, so it sits below this even when the engine keeps up.
        "offered_output_tok_s": sum(r.output_tokens for r in requests) / arrivals[-1],
        "ttft_p50_ms": summary.ttft.p50_ms if summary.ttft else None,
        "ttft_p99_ms": summary.ttft.p99_ms if summary.ttft else None,
        "tpot_p50_ms": summary.tpot.p50_ms if summary.tpot else None,
        "tpot_p99_ms": summary.tpot.p99_ms if summary.tpot else None,
        "queue_depth_mean": summary.queue_depth_mean,
        "queue_depth_max": summary.queue_depth_max,
        "requests": summary.requests,
        "completed": summary.completed,
        "arrival_span_s": arrivals[-1],
        "summary": asdict(summary),
        "engine": {k: extra[k] for k in ("engine_name", "kv_capacity_bytes")},
    }
    ttft, tpot = summary.ttft, summary.tpot
    log(
        f"  {mix} @ {rate:g} req/s: {summary.output_tok_s:.0f} tok/s, TTFT p50/p99 "
        f"{_ms(ttft.p50_ms if ttft else None)}/{_ms(ttft.p99_ms if ttft else None)} ms, "
        f"TPOT p50/p99 {_ms(tpot.p50_ms if tpot else None)}/"
        f"{_ms(tpot.p99_ms if tpot else None)} ms, queue mean "
        f"{_ms(summary.queue_depth_mean)} max {summary.queue_depth_max}"
        + ("" if not missed else f"; misses the SLO: {', '.join(missed)}")
    )
    return row


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def sweep(
    engine: PagedEngine,
    loaded: LoadedModel,
    config: EngineConfig,
    make_requests: Callable[[int, int], list[WorkloadRequest]],
    *,
    mix: str,
    rates: Sequence[float],
    duration_s: float,
    drain_s: float,
    seed: int,
    slo: Slo,
    log: Progress,
    stop_after_failures: int = 2,
    time_left: Callable[[], float] = lambda: float("inf"),
) -> list[dict[str, Any]]:
    """run_rate over ascending `rates` until `stop_after_failures` consecutive misses, or until
    the next rate could not finish in `time_left()` seconds."""
    rows: list[dict[str, Any]] = []
    failures = 0
    for rate in sorted(rates):
        if failures >= stop_after_failures:
            break
        if time_left() < duration_s + drain_s:
            log(f"  {mix} @ {rate:g} req/s skipped: the run's deadline is near")
            break
        row = run_rate(
            engine, loaded, config, make_requests, mix=mix, rate=rate,
            duration_s=duration_s, drain_s=drain_s, seed=seed, slo=slo, log=log,
        )  # fmt: skip
        rows.append(row)
        failures = 0 if row["meets_slo"] else failures + 1
    return rows
