"""The queue-order study's summary and files (fedsim/queue_study.py): NAME.json and NAME.md.

    python -m fedsim.queue_report PART.json [PART.json ...] --name NAME [--out DIR]

merges studies of the same setup run separately (one seed each, say: each within a few
minutes of CPU) into one report, as if one study had run them all.

Per arm, load and seed the run's figures; each arm against the baseline (the first arm) seed by
seed, the same requests in both: the ratio of mean latency (arrival to last token), of TTFT p50
and p99 (the mean over seeds of the arms' figures, divided, and each seed's ratio for the
spread); a ratio is "beyond the spread" only when every seed's is on the same side of 1. The
most later arrivals admitted ahead of any request, at the sites and in the gateway's queue,
against the SPF bound.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The study's goals at the highest load: SPF's mean latency and TTFT p50 at most this share of
# FCFS's, its TTFT p99 at most this multiple.
MEAN_GOAL = 0.75
P99_GOAL = 1.1
GOAL_LOAD = 0.95
METRICS = {"mean_latency": "mean_latency_s", "ttft_p50": "ttft_p50_s", "ttft_p99": "ttft_p99_s"}


def _label(arm: str) -> str:
    return arm.replace("@", "_")


def ratios(runs: dict[str, Any], arm: str, base: str, key: str) -> dict[str, Any]:
    """{load: {ratio, min, max, seeds}} of `arm` over `base` for one figure, paired by seed."""
    out: dict[str, Any] = {}
    for load, seeds in runs.get(arm, {}).items():
        base_seeds = runs.get(base, {}).get(load, {})
        common = sorted(s for s in seeds if s in base_seeds)
        if not common:
            continue
        mine = [seeds[s][key] for s in common]
        theirs = [base_seeds[s][key] for s in common]
        per_seed = [a / b if b > 0 else math.inf for a, b in zip(mine, theirs, strict=True)]
        out[load] = {
            "ratio": round(statistics.fmean(mine) / statistics.fmean(theirs), 4),
            "min": round(min(per_seed), 4),
            "max": round(max(per_seed), 4),
            "seeds": dict(zip(common, (round(r, 4) for r in per_seed), strict=True)),
        }
    return out


def summary(payload: dict[str, Any]) -> dict[str, Any]:
    runs, base = payload.get("runs", {}), payload["baseline"]
    bound = payload["spf"]["max_overtakes"]
    out: dict[str, Any] = {"vs_baseline": {}, "overtakes": {}}
    for arm in payload["arms"]:
        seen = {
            load: {
                "sites": max(r["site_overtakes_max"] for r in seeds.values()),
                "gateway": max(r["gateway_overtakes_max"] for r in seeds.values()),
                "held": max(r["held"] for r in seeds.values()),
            }
            for load, seeds in runs.get(arm, {}).items()
        }
        out["overtakes"][arm] = seen
        if arm == base:
            continue
        found = {name: ratios(runs, arm, base, key) for name, key in METRICS.items()}
        out["vs_baseline"][arm] = found
        unpredicted = f"{arm}@none"
        if "@" not in arm and unpredicted in runs:  # what the predictor buys this order
            out.setdefault("served_vs_none", {})[arm] = {
                name: ratios(runs, arm, unpredicted, key) for name, key in METRICS.items()
            }
        for name, by_load in found.items():
            key = f"{name}_vs_{_label(base)}"
            if key not in out:  # the first arm's ratios are the headline ({load: ratio})
                out[key] = {load: r["ratio"] for load, r in by_load.items()}
                out[f"{key}_min_max"] = {load: [r["min"], r["max"]] for load, r in by_load.items()}
    out["max_overtakes_bound"] = bound
    out["bound_held"] = all(
        v["sites"] <= bound and v["gateway"] <= bound
        for arm, loads in out["overtakes"].items()
        if arm.startswith("spf")
        for v in loads.values()
    )
    return out


def goals(payload: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals for the first arm against the baseline, at 0.95 of capacity (else the
    highest load run)."""
    arms = [a for a in payload["arms"] if a != payload["baseline"]]
    if not arms or not found["vs_baseline"].get(arms[0]):
        return {}
    by_metric = found["vs_baseline"][arms[0]]
    top = str(GOAL_LOAD if GOAL_LOAD in payload["loads"] else max(payload["loads"]))
    if top not in by_metric["mean_latency"]:
        return {}
    return {
        "load": top,
        f"mean_latency <= {MEAN_GOAL}": by_metric["mean_latency"][top]["ratio"] <= MEAN_GOAL,
        f"ttft_p50 <= {MEAN_GOAL}": by_metric["ttft_p50"][top]["ratio"] <= MEAN_GOAL,
        f"ttft_p99 <= {P99_GOAL}": by_metric["ttft_p99"][top]["ratio"] <= P99_GOAL,
        "no request overtaken beyond the bound": found["bound_held"],
    }


def markdown(payload: dict[str, Any]) -> str:
    found, base = payload["summary"], payload["baseline"]
    lines = [
        f"# {payload['name']}: queue order on the simulator",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Case {payload['case']['name']} (cards {', '.join(payload['case']['cards'])}), source "
        f"{payload['source']}, {payload['duration_s']:g} s of Poisson arrivals per point, seeds "
        f"{payload['seeds']}, the gateway's queue up to {payload['gateway_queue_requests']} "
        f"requests; SPF aging {payload['spf']['aging']} tokens per arrival, bound "
        f"{payload['spf']['max_overtakes']} overtakes. Wall time {payload.get('wall_s', 0)} s.",
        "",
        "Predictors: "
        + "; ".join(f"`{arm}`: {kind}" for arm, kind in payload["predictors"].items())
        + ".",
        "",
        "Capacity (a saturated FCFS run's answer tokens per second over its requests' mean "
        "answer, fedsim/queue_study.py): "
        + ", ".join(
            f"seed {s} {c['capacity_rps']:.1f} req/s" for s, c in payload["capacity"].items()
        )
        + ".",
        "",
        "| arm | load | seed | req/s | mean latency s | TTFT p50 s | TTFT p99 s | TPOT p99 s "
        "| held | most overtaken (sites / gateway) | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, loads in payload.get("runs", {}).items():
        for load, seeds in loads.items():
            for seed, r in seeds.items():
                lines.append(
                    f"| {arm} | {load} | {seed} | {r['rate']:.1f} | {r['mean_latency_s']:.3f} "
                    f"| {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['tpot_p99_s']:.4f} "
                    f"| {r['held']} | {r['site_overtakes_max']} / {r['gateway_overtakes_max']} "
                    f"| {r['cpu_s']} |"
                )
    lines += ["", f"Against `{base}` (mean over seeds of each, divided; per-seed min-max):", ""]
    lines += ["| arm | figure | " + " | ".join(f"load {x}" for x in payload["loads"]) + " |"]
    lines += ["|---|---|" + "---|" * len(payload["loads"])]
    for arm, metrics in found["vs_baseline"].items():
        lines += _ratio_rows(arm, metrics, payload["loads"])
    for arm, metrics in found.get("served_vs_none", {}).items():
        lines += ["", f"`{arm}` with its predictor against `{arm}@none` (no predictor):", ""]
        lines += ["| arm | figure | " + " | ".join(f"load {x}" for x in payload["loads"]) + " |"]
        lines += ["|---|---|" + "---|" * len(payload["loads"])]
        lines += _ratio_rows(arm, metrics, payload["loads"])
    if payload.get("findings"):
        lines += ["", payload["findings"]]
    if payload.get("goals"):
        lines += ["", "Goals: " + ", ".join(f"{k}: {v}" for k, v in payload["goals"].items())]
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: Path) -> None:
    """Each arm's ratios to the baseline against the load (bars: min-max over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4), sharex=True)
    for ax, name in zip(axes, METRICS, strict=True):
        for arm, metrics in payload["summary"]["vs_baseline"].items():
            loads = sorted(metrics[name], key=float)
            if not loads:
                continue
            mid = [metrics[name][x]["ratio"] for x in loads]
            lo = [m - metrics[name][x]["min"] for m, x in zip(mid, loads, strict=True)]
            hi = [metrics[name][x]["max"] - m for m, x in zip(mid, loads, strict=True)]
            xs = [float(x) for x in loads]
            ax.errorbar(xs, mid, yerr=[lo, hi], marker="o", capsize=3, label=arm)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"{name} / {payload['baseline']}", fontsize=9)
        ax.set_xlabel("load (x capacity)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio_rows(arm: str, metrics: dict[str, Any], loads: list[Any]) -> list[str]:
    """A row a figure: its ratio at each load with the per-seed min-max ("-": not run)."""
    rows = []
    for name, by_load in metrics.items():
        cells = [
            f"{by_load[str(x)]['ratio']:.3f} ({by_load[str(x)]['min']:.3f}-"
            f"{by_load[str(x)]['max']:.3f})"
            if str(x) in by_load
            else "-"
            for x in loads
        ]
        rows.append(f"| {arm} | {name} | " + " | ".join(cells) + " |")
    return rows


def render(payload: dict[str, Any], out: Path, name: str, figure: bool = False) -> None:
    """NAME.json and NAME.md (and NAME.png with `figure`)."""
    payload = dict(payload, name=name)
    payload["summary"] = summary(payload)
    payload["goals"] = goals(payload, payload["summary"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(payload))
    if figure and payload["summary"]["vs_baseline"]:
        plot(payload, out / f"{name}.png")


SETUP_KEYS = ("case", "source", "trace_file", "arms", "baseline", "loads", "duration_s", "spf",
              "gateway_queue_requests", "predictors")  # fmt: skip


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Studies of one setup (SETUP_KEYS) over different seeds, as one."""
    first = parts[0]
    for part in parts[1:]:
        for key in SETUP_KEYS:
            if part.get(key) != first.get(key):
                raise ValueError(f"studies differ in {key}: {part.get(key)} vs {first.get(key)}")
    merged: dict[str, Any] = {key: first.get(key) for key in (*SETUP_KEYS, "saturate")}
    merged["commands"] = [p["command"] for p in parts]
    merged["command"] = " ; ".join(merged["commands"])
    merged["seeds"] = [s for p in parts for s in p["seeds"]]
    merged["wall_s"] = sum(p.get("wall_s", 0) for p in parts)
    merged["capacity"] = {k: v for p in parts for k, v in p["capacity"].items()}
    runs: dict[str, Any] = {}
    for part in parts:
        for arm, loads in part["runs"].items():
            for load, seeds in loads.items():
                runs.setdefault(arm, {}).setdefault(load, {}).update(seeds)
    merged["runs"] = runs
    return merged


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.queue_report")
    parser.add_argument("parts", type=Path, nargs="+")
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", type=Path, default=Path("bench/results/sim"))
    parser.add_argument("--findings", type=Path, default=None, help="a Markdown paragraph")
    args = parser.parse_args(argv)
    merged = merge([json.loads(p.read_text()) for p in args.parts])
    this = " ".join(sys.argv[1:] if argv is None else argv)
    merged["command"] += f" ; merged by: python -m fedsim.queue_report {this}"
    if args.findings is not None:
        merged["findings"] = args.findings.read_text().strip()
    render(merged, args.out, args.name, figure=True)
    print((args.out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
