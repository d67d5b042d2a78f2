"""The routing study: goodput at the SLO of each routing profile over federations of unequal
cards and wide-area round trips (docs/simulator.md).

    python -m fedsim.study [--quick] [--seeds 3] [--out bench/results/sim]

For each case (sites and their cards and round trips, a workload) and seed, each arm's goodput
is the highest arrival rate at which every request is served with TTFT p99 <= 2 s and TPOT
p99 <= 100 ms, found by bisection on the rate (the same requests, arriving faster). Writes
routing.{json,md,png}: per arm, case and seed the goodput; `default_vs_round_robin_min` and
`default_vs_best_arm_min` (the default arm's goodput over round robin's and over the best arm's,
the mean over seeds, the minimum over cases).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast, get_args

from fedsim.cards import CARDS, MODELS
from fedsim.federation import Slo, run
from fedsim.gateway import GatewaySettings
from fedsim.prompts import SERVED_ARTIFACT
from fedsim.site import SiteSpec
from fedsim.step_models import STEP_MODELS, step_model
from fedsim.study_report import markdown, merge, render
from fedsim.workload import Predictor, Source, WorkloadSpec, build, prediction_kind
from gateway.settings import RoutingSettings

ARMS = (
    "round_robin",
    "least_requests",
    "mico",
    "completion_cost",
    "prefix_affinity",
    "least_latency",
)
RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "sim"


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    cards: tuple[str, ...]
    rtts_s: tuple[float, ...]
    source: Source = "sharegpt"
    adapters: int = 0
    adapter_share: float = 0.0
    model: str = "llama8b"

    @property
    def unequal(self) -> bool:
        return len(set(self.cards)) > 1

    def sites(self, models: Path = STEP_MODELS) -> list[SiteSpec]:
        loras = 8 if self.adapters else 0
        return [
            SiteSpec(
                f"{self.name}-{i}",
                CARDS[card],
                MODELS[self.model],
                step_model(card, self.model, models),
                rtt,
                max_num_seqs=256,
                max_num_batched_tokens=2048,
                max_loras=loras,
                max_cpu_loras=4 * loras,
                max_model_len=8192,
            )
            for i, (card, rtt) in enumerate(zip(self.cards, self.rtts_s, strict=True))
        ]


def _spread(n: int, low: float = 0.005, high: float = 0.15) -> tuple[float, ...]:
    """n round trips from `low` to `high` seconds, evenly (5-150 ms: a region to a continent)."""
    return tuple(low + (high - low) * i / max(n - 1, 1) for i in range(n))


def _mixed(n: int) -> tuple[str, ...]:
    """Unequal cards: a quarter H200, half H100, a quarter the smaller card."""
    return tuple(("h200", "h100", "h100", "l40s")[i % 4] for i in range(n))


def cases(quick: bool) -> list[Case]:
    out = [
        Case("4_equal_sharegpt", ("h100",) * 4, _spread(4)),
        Case("4_unequal_sharegpt", _mixed(4), _spread(4)),
        Case("4_unequal_mooncake", _mixed(4), _spread(4), source="mooncake"),
        Case("4_unequal_lora", _mixed(4), _spread(4), adapters=32, adapter_share=0.8),
    ]
    if not quick:
        out += [
            Case("16_equal_sharegpt", ("h100",) * 16, _spread(16)),
            Case("16_unequal_sharegpt", _mixed(16), _spread(16)),
        ]
    return out


def goodput(
    meets: Callable[[float], bool],
    guess: float,
    steps: int,
    floor: float = 0.05,
    grow: float = 2.0,
) -> float:
    """The highest rate at which `meets` holds: from `guess`, up by `grow` until it fails or down
    by `grow` until it holds, to bracket it, then bisection; 0 when even `floor` x guess fails.
    A `grow` near 1 with a guess near the answer spends the runs near it (a 30 s run of 16 sites
    at their goodput costs a minute of CPU; one far above it stops early, at `give_up`)."""
    if grow <= 1.0:
        raise ValueError(f"grow must exceed 1, not {grow}")
    if meets(guess):
        lo, hi = guess, guess * grow
        while meets(hi):
            lo, hi = hi, hi * grow
            if hi > 64 * guess:
                raise ValueError(f"goodput beyond 64x the guess {guess}: the guess is wrong")
    else:
        lo, hi = guess / grow, guess
        while not meets(lo):
            lo, hi = lo / grow, lo
            if lo < guess * floor:
                return 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def arm_goodput(
    case: Case,
    arm: str,
    seed: int,
    duration_s: float,
    steps: int,
    slo: Slo,
    traces: Path | None,
    models: Path = STEP_MODELS,
    guess: float | None = None,
    grow: float = 2.0,
    trace_file: Path | None = None,
    artifact: Path = SERVED_ARTIFACT,
) -> dict[str, Any]:
    """One arm's goodput in one case and seed, and the runs the bisection made. An arm is a
    routing profile, or `profile@predictor` (served, oracle, none: fedsim/workload.py) to
    measure what predicted lengths buy it."""
    policy, _, how = arm.partition("@")
    predictor = cast(Predictor, how or "served")
    if predictor not in get_args(Predictor):
        raise ValueError(f"arm {arm!r}: predictor must be one of {get_args(Predictor)}")
    sites = case.sites(models)
    if guess is None:
        guess = first_guess(case)
    spec = WorkloadSpec(
        "file" if trace_file is not None else case.source,
        guess,
        duration_s,
        seed,
        predictor,
        8192,
        case.adapters,
        case.adapter_share,
        traces,
        trace_file=trace_file,
        predictor_artifact=artifact,
    )
    runs: list[dict[str, Any]] = []
    settings = GatewaySettings(policy=policy)

    def meets(rate: float) -> bool:
        # The seed's lengths in the same order, Poisson arrivals at `rate`.
        requests = build(replace(spec, rate=rate))
        began = time.perf_counter()
        result = run(sites, requests, settings, drain_s=120.0, give_up=slo)
        runs.append({"rate": rate, "wall_s": time.perf_counter() - began} | result.summary())
        print(f"    {case.name} {arm} seed {seed} @ {rate:.2f}/s: {runs[-1]}", flush=True)
        return result.meets(slo)

    rate = goodput(meets, guess, steps, grow=grow)
    return {
        "goodput_rps": rate,
        "guess_rps": guess,
        "grow": grow,
        "predictor": prediction_kind(spec),
        "runs": runs,
    }


def first_guess(case: Case) -> float:
    """About what an H100 site of the 8B shape serves of ShareGPT-like traffic at the SLO, per
    site scaled by its card's bandwidth: 45 req/s on the grid-fitted step models (4 unequal
    sites served 161-171 req/s in a 12 s study, 2.2-2.3x the 20 req/s the pre-grid models
    suggested)."""
    return 45.0 * sum(
        CARDS[c].bandwidth_bytes_s / CARDS["h100"].bandwidth_bytes_s for c in case.cards
    )


def warm_guess(case: Case, found: dict[str, dict[str, float]]) -> float:
    """The mean goodput found so far in this case (over arms and seeds), else first_guess: the
    next arm's answer is most likely near the others'."""
    rates = [r for seeds in found.values() for r in seeds.values() if r > 0]
    return statistics.fmean(rates) if rates else first_guess(case)


def write(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    slo: Slo,
    chosen: Sequence[Case],
    table: dict[str, dict[str, dict[str, float]]],
    details: dict[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    """routing.{json,md,png} of what is measured so far (written after every arm: a study
    stopped midway keeps what it found)."""
    command = "python -m fedsim.study " + " ".join(sys.argv[1:] if argv is None else argv)
    part = {
        "command": command,
        "slo": {"ttft_p99_s": slo.ttft_p99_s, "tpot_p99_s": slo.tpot_p99_s},
        "seeds": args.seeds,
        "trace_file": str(args.trace_file) if args.trace_file else None,
        "arms": args.arms,
        "default": args.default,
        "grow": args.grow,
        "bisection_steps": args.bisection_steps,
        "cases": {
            c.name: {
                "cards": c.cards,
                "rtts_s": c.rtts_s,
                "source": c.source,
                "adapters": c.adapters,
                "model": c.model,
            }
            for c in chosen
        },
        "goodput_rps": table,
        "complete": len(details) == len(chosen) * len(args.arms) * args.seeds,
        "runs": details,
        "wall_s": wall_s,
    }
    payload = merge([part])
    render(payload, args.out)
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.study")
    parser.add_argument("--quick", action="store_true", help="the 4-site cases only")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--seed-ids",
        type=int,
        nargs="*",
        default=None,
        help="these seeds instead of 0..--seeds-1 (to add seeds to a study: study_report merges)",
    )
    parser.add_argument("--arms", nargs="*", default=list(ARMS))
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument("--default", default=RoutingSettings().policy, help="the product's")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--bisection-steps", type=int, default=4)
    parser.add_argument("--traces", type=Path, default=None)
    parser.add_argument(
        "--trace-file",
        type=Path,
        default=None,
        help="every case's workload from this trace (fedsim/traces.py: Mooncake's JSON lines "
        "or Azure's CSV), instead of the case's own source",
    )
    parser.add_argument("--predictor-artifact", type=Path, default=SERVED_ARTIFACT)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--step-models", type=Path, default=STEP_MODELS)
    parser.add_argument(
        "--grow",
        type=float,
        default=2.0,
        help="bracket the goodput by this factor from the guess (e.g. 1.2 with --warm)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="guess each arm and seed at the mean goodput found so far in its case",
    )
    args = parser.parse_args(argv)
    slo = Slo()
    chosen = [c for c in cases(args.quick) if args.cases is None or c.name in args.cases]
    table: dict[str, dict[str, dict[str, float]]] = {}
    details: dict[str, Any] = {}
    began = time.perf_counter()
    seeds = range(args.seeds) if args.seed_ids is None else args.seed_ids
    args.seeds = len(seeds)
    # Seeds outermost within a case: a study stopped midway holds every arm of the first seeds,
    # each a paired comparison (the same requests), rather than all seeds of the first arms.
    for case in chosen:
        for seed in seeds:
            for arm in args.arms:
                found = arm_goodput(
                    case,
                    arm,
                    seed,
                    args.duration_s,
                    args.bisection_steps,
                    slo,
                    args.traces,
                    args.step_models,
                    warm_guess(case, table.get(case.name, {})) if args.warm else None,
                    args.grow,
                    args.trace_file,
                    args.predictor_artifact,
                )
                table.setdefault(case.name, {}).setdefault(arm, {})[str(seed)] = found[
                    "goodput_rps"
                ]
                details[f"{case.name}/{arm}/{seed}"] = found
                write(args, argv, slo, chosen, table, details, time.perf_counter() - began)
                print(
                    f"[{time.perf_counter() - began:7.0f}s] {case.name} {arm} seed {seed}: "
                    f"{found['goodput_rps']:.2f} req/s",
                    flush=True,
                )
    payload = write(args, argv, slo, chosen, table, details, time.perf_counter() - began)
    if payload["summary"]:
        print(markdown(payload))


if __name__ == "__main__":
    main()
