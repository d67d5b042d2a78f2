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
import json
import math
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
from fedsim.site import SiteSpec
from fedsim.step_models import STEP_MODELS, step_model
from fedsim.workload import Predictor, Source, WorkloadSpec, build

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


def goodput(meets: Callable[[float], bool], guess: float, steps: int, floor: float = 0.05) -> float:
    """The highest rate at which `meets` holds, by doubling from `guess` to bracket it, then
    bisection; 0 when even `floor` x guess fails."""
    lo, hi = 0.0, guess
    while meets(hi):
        lo, hi = hi, hi * 2
        if hi > 64 * guess:
            raise ValueError(f"goodput beyond 64x the guess {guess}: the guess is wrong")
    if lo == 0.0:
        if not meets(guess * floor):
            return 0.0
        lo = guess * floor
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
) -> dict[str, Any]:
    """One arm's goodput in one case and seed, and the runs the bisection made. An arm is a
    routing profile, or `profile@predictor` (served, oracle, none: fedsim/workload.py) to
    measure what predicted lengths buy it."""
    policy, _, how = arm.partition("@")
    predictor = cast(Predictor, how or "served")
    if predictor not in get_args(Predictor):
        raise ValueError(f"arm {arm!r}: predictor must be one of {get_args(Predictor)}")
    sites = case.sites(models)
    # About what an H100 site of the 8B shape serves of ShareGPT-like traffic at the SLO.
    guess = 20.0 * sum(
        CARDS[c].bandwidth_bytes_s / CARDS["h100"].bandwidth_bytes_s for c in case.cards
    )
    spec = WorkloadSpec(
        case.source,
        guess,
        duration_s,
        seed,
        predictor,
        8192,
        case.adapters,
        case.adapter_share,
        traces,
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

    rate = goodput(meets, guess, steps)
    return {"goodput_rps": rate, "runs": runs}


def summarize(table: dict[str, dict[str, dict[str, float]]], default: str) -> dict[str, Any]:
    """Per case the mean goodput over seeds of each arm; the default's ratios, the minimum over
    round robin taken over the cases of unequal cards (the issue's bound; over every case too)."""
    means = {
        case: {arm: statistics.fmean(seeds.values()) for arm, seeds in arms.items()}
        for case, arms in table.items()
    }
    vs_rr = {c: _ratio(m[default], m.get("round_robin", 0.0)) for c, m in means.items()}
    vs_best = {c: _ratio(m[default], max(m.values())) for c, m in means.items()}
    best = {c: max(m, key=lambda a: m[a]) for c, m in means.items()}
    return {
        "mean_goodput_rps": means,
        "best_arm": best,
        "default_vs_round_robin": vs_rr,
        "default_vs_best_arm": vs_best,
        "default_vs_round_robin_min": min(
            (r for c, r in vs_rr.items() if "unequal" in c), default=math.nan
        ),
        "default_vs_round_robin_min_all_cases": min(vs_rr.values()),
        "default_vs_best_arm_min": min(vs_best.values()),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf") if a > 0 else 1.0


def _markdown(payload: dict[str, Any]) -> str:
    s = payload["summary"]
    arms = payload["arms"]
    lines = [
        "# Routing study (fedsim)",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Goodput at the SLO (TTFT p99 <= {payload['slo']['ttft_p99_s']} s, TPOT p99 <= "
        f"{payload['slo']['tpot_p99_s']} s), requests/s, mean over seeds "
        f"{payload['seeds']}; default arm `{payload['default']}`.",
        "",
        "| case | " + " | ".join(arms) + " | default / round robin | default / best |",
        "|---|" + "---|" * (len(arms) + 2),
    ]
    for case, means in s["mean_goodput_rps"].items():
        cells = " | ".join(f"{means.get(a, float('nan')):.2f}" for a in arms)
        lines.append(
            f"| {case} | {cells} | {s['default_vs_round_robin'][case]:.2f} | "
            f"{s['default_vs_best_arm'][case]:.2f} |"
        )
    lines += [
        "",
        f"default_vs_round_robin_min = {s['default_vs_round_robin_min']:.3f}, "
        f"default_vs_best_arm_min = {s['default_vs_best_arm_min']:.3f}",
    ]
    return "\n".join(lines) + "\n"


def _plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = payload["summary"]["mean_goodput_rps"]
    arms = payload["arms"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(means)), 4))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs = [j + i * width for j in range(len(means))]
        ax.bar(xs, [m.get(arm, 0.0) for m in means.values()], width, label=arm)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(means))], list(means), rotation=15)
    ax.set_ylabel("goodput at the SLO (requests/s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    complete = {c: arms for c, arms in table.items() if args.default in arms}
    command = "python -m fedsim.study " + " ".join(sys.argv[1:] if argv is None else argv)
    payload = {
        "command": command,
        "slo": {"ttft_p99_s": slo.ttft_p99_s, "tpot_p99_s": slo.tpot_p99_s},
        "seeds": args.seeds,
        "arms": args.arms,
        "default": args.default,
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
        "summary": summarize(complete, args.default) if complete else {},
        "complete": len(details) == len(chosen) * len(args.arms) * args.seeds,
        "runs": details,
        "wall_s": wall_s,
    }
    if complete:
        keys = ("default_vs_round_robin_min", "default_vs_best_arm_min")
        payload |= {k: payload["summary"][k] for k in keys}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing.json").write_text(json.dumps(payload, indent=2) + "\n")
    if complete:
        (args.out / "routing.md").write_text(_markdown(payload))
        _plot(payload, args.out / "routing.png")
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.study")
    parser.add_argument("--quick", action="store_true", help="the 4-site cases only")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--arms", nargs="*", default=list(ARMS))
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument("--default", default="completion_cost")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--bisection-steps", type=int, default=4)
    parser.add_argument("--traces", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--step-models", type=Path, default=STEP_MODELS)
    args = parser.parse_args(argv)
    slo = Slo()
    chosen = [c for c in cases(args.quick) if args.cases is None or c.name in args.cases]
    table: dict[str, dict[str, dict[str, float]]] = {}
    details: dict[str, Any] = {}
    began = time.perf_counter()
    for case in chosen:
        for arm in args.arms:
            for seed in range(args.seeds):
                found = arm_goodput(
                    case,
                    arm,
                    seed,
                    args.duration_s,
                    args.bisection_steps,
                    slo,
                    args.traces,
                    args.step_models,
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
    print(_markdown(payload))


if __name__ == "__main__":
    main()
