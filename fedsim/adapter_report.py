"""The adapter-routing study's arms and its report (fedsim/adapter_study.py): per load and arm the
mean over seeds with its min-max, and the verdict: adapter affinity wins where its worst seed beats
adapter-blind `completion_cost`'s best (beyond the seed spread) on goodput or TTFT p99."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.routing.adapter_affinity import AdapterRouting


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    policy: str
    adapter_routing: AdapterRouting


AFFINITY = Arm("completion_cost+affinity", "completion_cost", "affinity")
BLIND = Arm("completion_cost_blind", "completion_cost", "blind")
ARMS = (AFFINITY, BLIND, Arm("least_requests", "least_requests", "blind"))
METRICS = (
    ("goodput_rps", "goodput req/s", "{:.1f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
    ("adapter_loads_per_site_mean", "adapter loads / site", "{:.0f}"),
    ("distinct_adapters_per_site_mean", "distinct adapters / site", "{:.0f}"),
)


def spread(rows: Sequence[dict[str, Any]], key: str) -> tuple[float, float, float]:
    """(mean, min, max) of `key` over `rows` (one per seed)."""
    values = [float(r[key]) for r in rows]
    return sum(values) / len(values), min(values), max(values)


def verdict(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per load: does affinity beat blind beyond the seed spread (its worst seed better than
    blind's best) on goodput (higher) or TTFT p99 (lower), and is it worse beyond it on either?
    `winner` overall: blind if affinity loses at some load and wins at none, else affinity."""
    loads = sorted({p["load"] for p in points})
    per_load: dict[str, dict[str, bool]] = {}
    for load in loads:
        aff = [p for p in points if p["load"] == load and p["arm"] == AFFINITY.name]
        blind = [p for p in points if p["load"] == load and p["arm"] == BLIND.name]
        if not aff or not blind:
            continue
        _, aff_good_lo, aff_good_hi = spread(aff, "goodput_rps")
        _, bl_good_lo, bl_good_hi = spread(blind, "goodput_rps")
        _, aff_p99_lo, aff_p99_hi = spread(aff, "ttft_p99_s")
        _, bl_p99_lo, bl_p99_hi = spread(blind, "ttft_p99_s")
        per_load[f"{load:g}"] = {
            "affinity_better": aff_good_lo > bl_good_hi or aff_p99_hi < bl_p99_lo,
            "affinity_worse": aff_good_hi < bl_good_lo or aff_p99_lo > bl_p99_hi,
        }
    wins = any(v["affinity_better"] for v in per_load.values())
    losses = any(v["affinity_worse"] for v in per_load.values())
    # Undecided: the gateway's default stays what it was (affinity, since issue 51).
    winner = BLIND.adapter_routing if losses and not wins else AFFINITY.adapter_routing
    return {"per_load": per_load, "winner": winner, "decided": wins != losses}


def markdown(report: dict[str, Any]) -> str:
    points = report["points"]
    seeds = sorted({p["seed"] for p in points})
    durations = sorted({p["duration_s"] for p in points})
    lines = [
        "# Adapter routing on the simulator: affinity against adapter-blind completion_cost",
        "",
        f"Command: `{report['command']}`. {len(report['cards'])} unequal sites "
        f"({', '.join(report['cards'])}; 5-150 ms), the 8B shape, every request one of "
        f"{report['adapters']:,} LoRA adapters by Zipf(1), ShareGPT-like lengths, Poisson "
        f"arrivals for {', '.join(f'{d:g}' for d in durations)} s a point, seeds "
        f"{', '.join(map(str, seeds))} paired. Sites: {report['max_loras']} device slots, "
        f"{report['max_cpu_loras']} in host memory, an adapter read from disk in "
        f"{report['adapter_load_s']:.3f} s (measured: 8B rank 16, lora_loading_cpu.md). "
        f"Load is a share of the nominal capacity, {report['capacity_rps']:.0f} req/s (the "
        "base model's; fedsim.study.first_guess). Goodput: completed requests with TTFT <= "
        f"{report['slo']['ttft_s']:g} s and TPOT <= {report['slo']['tpot_s']:g} s per second of "
        "arrivals. Cells: mean over seeds (min-max).",
        "",
        "| load | arm | " + " | ".join(label for _, label, _ in METRICS) + " |",
        "|---|---|" + "---|" * len(METRICS),
    ]
    for load in sorted({p["load"] for p in points}):
        for arm in ARMS:
            rows = [p for p in points if p["load"] == load and p["arm"] == arm.name]
            if not rows:
                continue
            cells = []
            for key, _, fmt in METRICS:
                mean, lo, hi = spread(rows, key)
                cells.append(f"{fmt.format(mean)} ({fmt.format(lo)}-{fmt.format(hi)})")
            lines.append(f"| {load:g} | {arm.name} | " + " | ".join(cells) + " |")
    result = verdict(points)
    lines += ["", "Affinity against blind, beyond the seed spread (worst seed vs best seed):", ""]
    for load, v in result["per_load"].items():
        better, worse = v["affinity_better"], v["affinity_worse"]
        said = "better" if better and not worse else "worse" if worse and not better else "no call"
        lines.append(f"- load {load}: affinity {said}")
    lines += [
        "",
        f"Default chosen (GATEWAY_ADAPTER_ROUTING): **{result['winner']}**"
        + ("" if result["decided"] else " (no difference beyond the seed spread: kept as is)"),
    ]
    return "\n".join(lines) + "\n"
