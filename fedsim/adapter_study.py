"""The adapter-routing study (issue 69): does routing by adapter residency beat adapter-blind
`completion_cost` with many sites and many LoRA adapters?

16 unequal sites (4 H200, 8 H100, 4 L40S; 5-150 ms round trips; the 8B shape), every request
naming one of 1,000 adapters by Zipf(1) popularity, ShareGPT-like lengths, Poisson arrivals for
`--duration-s` at 0.6 and 0.9 of the federation's nominal capacity (fedsim.study.first_guess:
45 req/s per H100-equivalent of bandwidth, the base model's goodput at the SLO), three seeds
paired (the same requests in every arm). Each site has the LoRA engine bench's slots
(bench/engine/lora.py: 64 device slots, 160 in host memory) and reads a missing adapter from disk
in ADAPTER_LOAD_S (measured, below). Arms: `completion_cost` with GATEWAY_ADAPTER_ROUTING
`affinity` and `blind`, and `least_requests` (adapter-blind). Runs to the end (no give-up): TTFT
p50/p99 of completed requests, goodput (requests/s that completed within the SLO's TTFT and
TPOT), adapter reads from disk and distinct adapters per site.

    python -m fedsim.adapter_study [--seeds 0 1 2] [--loads 0.6 0.9] [--duration-s 30] [--jobs 2]

Writes bench/results/sim/adapter_routing.{json,md} (fedsim/adapter_report.py). Points already in
the JSON (same arm, load, seed, duration) are kept, so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedsim.adapter_report import ARMS, Arm, markdown
from fedsim.federation import RunResult, Slo, run
from fedsim.gateway import GatewaySettings
from fedsim.site import SiteSpec
from fedsim.study import RESULTS, Case, _mixed, _spread, first_guess
from fedsim.workload import WorkloadSpec, build

ADAPTERS = 1000
# An 8B rank-16 adapter (83.9 MB) read from disk and laid out: 120 ms p50 cold (bench/results/
# engine_lora/lora_loading_cpu.md, `now_cold`), plus its copy to the device over PCIe (~3 ms at
# 25 GB/s).
ADAPTER_LOAD_S = 0.123
MAX_LORAS, MAX_CPU_LORAS = 64, 160  # bench/engine/lora.py's GPU run
CASE = Case("16_unequal_lora1000", _mixed(16), _spread(16), adapters=ADAPTERS, adapter_share=1.0)
SLO = Slo()


@dataclass(frozen=True, slots=True)
class Point:
    arm: Arm
    load: float
    seed: int
    duration_s: float

    @property
    def key(self) -> str:
        return f"{self.arm.name}|{self.load:g}|{self.seed}|{self.duration_s:g}"


def sites() -> list[SiteSpec]:
    return [
        replace(s, max_loras=MAX_LORAS, max_cpu_loras=MAX_CPU_LORAS, adapter_load_s=ADAPTER_LOAD_S)
        for s in CASE.sites()
    ]


def capacity_rps() -> float:
    return first_guess(CASE)


def goodput_rps(result: RunResult, duration_s: float) -> float:
    """Completed requests within the SLO's TTFT and TPOT bounds, per second of arrivals."""
    good = sum(
        1
        for o in result.outcomes
        if o.completed
        and o.ttft_s is not None
        and o.ttft_s <= SLO.ttft_p99_s
        and (o.tpot_s or 0.0) <= SLO.tpot_p99_s
    )
    return good / duration_s


def run_point(point: Point) -> dict[str, Any]:
    rate = point.load * capacity_rps()
    spec = WorkloadSpec("sharegpt", rate, point.duration_s, point.seed, "served", 8192,
                        ADAPTERS, 1.0)  # fmt: skip
    settings = GatewaySettings(policy=point.arm.policy, adapter_routing=point.arm.adapter_routing)
    began = time.process_time()
    result = run(sites(), build(spec), settings, drain_s=60.0)
    loads = list(result.adapter_loads.values())
    served = list(result.adapters_served.values())
    return {
        "arm": point.arm.name,
        "load": point.load,
        "seed": point.seed,
        "duration_s": point.duration_s,
        "rate_rps": rate,
        "requests": result.requests,
        "completed": result.completed,
        "ttft_p50_s": result.ttft_p50,
        "ttft_p99_s": result.ttft_p99,
        "tpot_p99_s": result.tpot_p99,
        "goodput_rps": goodput_rps(result, point.duration_s),
        "adapter_loads_per_site_mean": sum(loads) / len(loads),
        "adapter_loads_per_site_max": max(loads),
        "distinct_adapters_per_site_mean": sum(served) / len(served),
        "distinct_adapters_per_site_max": max(served),
        "adapter_loads": result.adapter_loads,
        "adapters_served": result.adapters_served,
        "cpu_s": time.process_time() - began,
    }


def study(points: Sequence[Point], out: Path, jobs: int) -> dict[str, Any]:
    path = out / "adapter_routing.json"
    done: dict[str, dict[str, Any]] = {}
    if path.exists():
        for row in json.loads(path.read_text()).get("points", []):
            done[f"{row['arm']}|{row['load']:g}|{row['seed']}|{row['duration_s']:g}"] = row
    todo = [p for p in points if p.key not in done]
    with ProcessPoolExecutor(max_workers=max(jobs, 1)) as pool:
        for point, row in zip(todo, pool.map(run_point, todo), strict=True):
            done[point.key] = row
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, dict)}), flush=True)
            _write(out, done)
    return _write(out, done)


def _write(out: Path, done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    report = {
        "command": "python -m fedsim.adapter_study",
        "case": CASE.name,
        "cards": list(CASE.cards),
        "adapters": ADAPTERS,
        "adapter_load_s": ADAPTER_LOAD_S,
        "max_loras": MAX_LORAS,
        "max_cpu_loras": MAX_CPU_LORAS,
        "capacity_rps": capacity_rps(),
        "slo": {"ttft_s": SLO.ttft_p99_s, "tpot_s": SLO.tpot_p99_s},
        "points": sorted(done.values(), key=lambda r: (r["load"], r["arm"], r["seed"])),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_routing.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "adapter_routing.md").write_text(markdown(report))
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.adapter_study")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.9])
    parser.add_argument("--arms", nargs="+", default=[a.name for a in ARMS])
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    arms = {a.name: a for a in ARMS}
    unknown = set(args.arms) - set(arms)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; known: {sorted(arms)}")
    # The two completion_cost arms first, paired per load and seed (the question), the
    # baselines after: what an interrupted study has answers the question.
    points = sorted(
        (
            Point(arms[name], load, seed, args.duration_s)
            for load in args.loads
            for seed in args.seeds
            for name in args.arms
        ),
        key=lambda p: p.arm.policy != "completion_cost",
    )
    report = study(points, args.out, args.jobs)
    print(markdown(report))


if __name__ == "__main__":
    main()
