"""The routing study's summary and its files: routing.{json,md,png} from the goodput table
(per case, arm and seed), with the spread over seeds and a verdict only beyond it.

    python -m fedsim.study_report A/routing.json [B/routing.json ...] --out DIR [--notes FILE]

merges studies run separately (cases of one default arm) into one report, as if one study had
run them all; `--notes` adds the findings in words.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The arms that use no predicted answer length: the "load-only" policies predicted lengths must
# beat to pay (completion_cost, mico and least_latency plan with the predictor's length).
LOAD_ONLY = ("round_robin", "least_requests", "prefix_affinity")
PREDICTED = ("completion_cost", "mico", "least_latency")

Table = dict[str, dict[str, dict[str, float]]]  # case -> arm -> seed -> goodput (req/s)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf if a > 0 else 1.0


def resolution(grow: float, steps: int) -> float:
    """The bisection's last bracket as a share of the rate: a ratio within 1 +- this is a tie."""
    return (grow - 1.0) / float(2**steps)


def paired(seeds_a: dict[str, float], seeds_b: dict[str, float]) -> list[float]:
    """a / b per seed both ran (the same requests in the same order: a paired comparison)."""
    return [ratio(seeds_a[s], seeds_b[s]) for s in sorted(seeds_a) if s in seeds_b]


def mean_ratio(seeds_a: dict[str, float], seeds_b: dict[str, float]) -> float:
    """a's mean over b's, over the seeds both ran (an arm short of seeds is not compared with
    another's other seeds)."""
    common = [s for s in seeds_a if s in seeds_b]
    if not common:
        return math.nan
    return ratio(
        statistics.fmean(seeds_a[s] for s in common), statistics.fmean(seeds_b[s] for s in common)
    )


def verdict(ratios: Sequence[float], tie: float) -> str:
    """`wins` / `loses` only when every seed says so by more than the bisection's resolution."""
    if ratios and min(ratios) > 1.0 + tie:
        return "wins"
    if ratios and max(ratios) < 1.0 - tie:
        return "loses"
    return "within spread"


def _case_summary(arms: dict[str, dict[str, float]], default: str, tie: float) -> dict[str, Any]:
    means = {arm: statistics.fmean(seeds.values()) for arm, seeds in arms.items()}
    best = max(means, key=lambda a: means[a])
    load_only = [a for a in LOAD_ONLY if a in means]
    strongest = max(load_only, key=lambda a: means[a]) if load_only else None
    vs_rr = paired(arms[default], arms["round_robin"]) if "round_robin" in arms else []
    vs_best = paired(arms[default], arms[best])
    out: dict[str, Any] = {
        "mean": means,
        "min_max": {a: [min(s.values()), max(s.values())] for a, s in arms.items()},
        "best_arm": best,
        "default_vs_round_robin": (
            mean_ratio(arms[default], arms["round_robin"]) if "round_robin" in arms else math.nan
        ),
        "default_vs_round_robin_by_seed": vs_rr,
        "default_vs_best_arm": mean_ratio(arms[default], arms[best]),
        "default_vs_best_arm_by_seed": vs_best,
        "strongest_load_only": strongest,
    }
    if strongest is not None:
        out["predicted_vs_strongest_load_only"] = {
            arm: {
                "mean_ratio": mean_ratio(arms[arm], arms[strongest]),
                "by_seed": (r := paired(arms[arm], arms[strongest])),
                "verdict": verdict(r, tie),
            }
            for arm in PREDICTED
            if arm in arms
        }
    # `arm@none` plans the answer without a prediction: arm over it is what the predictor buys.
    out["arm_vs_no_prediction"] = {
        arm: {
            "mean_ratio": mean_ratio(arms[arm], arms[f"{arm}@none"]),
            "by_seed": (r := paired(arms[arm], arms[f"{arm}@none"])),
            "verdict": verdict(r, tie),
        }
        for arm in arms
        if f"{arm}@none" in arms
    }
    return out


def summarize(table: Table, default: str, tie: float = 0.0) -> dict[str, Any]:
    """Per case each arm's mean and min-max over seeds, the default's ratios (of means, and per
    seed paired), and where the predicted-length arms beat the strongest load-only arm.
    `default_vs_round_robin_min`: the minimum over the unequal cases of the ratio of means
    (the issue's bound); `default_vs_best_arm_min`: over every case. `*_seed_min`: the same
    taken over every seed's paired ratio, the pessimistic reading."""
    cases = {c: _case_summary(arms, default, tie) for c, arms in table.items()}
    unequal = [c for c in cases if "unequal" in c]
    rr = [c for c in cases if cases[c]["default_vs_round_robin_by_seed"]]
    return {
        "cases": cases,
        "mean_goodput_rps": {c: s["mean"] for c, s in cases.items()},
        "tie_resolution": tie,
        "default_vs_round_robin_min": min(
            (cases[c]["default_vs_round_robin"] for c in unequal if c in rr), default=math.nan
        ),
        "default_vs_round_robin_min_all_cases": min(
            (cases[c]["default_vs_round_robin"] for c in rr), default=math.nan
        ),
        "default_vs_round_robin_seed_min": min(
            (r for c in rr for r in cases[c]["default_vs_round_robin_by_seed"]), default=math.nan
        ),
        "default_vs_best_arm_min": min(s["default_vs_best_arm"] for s in cases.values()),
        "default_vs_best_arm_seed_min": min(
            r for s in cases.values() for r in s["default_vs_best_arm_by_seed"]
        ),
    }


def _range(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def markdown(payload: dict[str, Any]) -> str:
    s = payload["summary"]
    arms = payload["arms"]
    lines = [
        "# Routing study (fedsim)",
        "",
        "Command: " + "; ".join(f"`{c}`" for c in payload["commands"]),
        "",
        f"Goodput at the SLO (TTFT p99 <= {payload['slo']['ttft_p99_s']} s, TPOT p99 <= "
        f"{payload['slo']['tpot_p99_s']} s), requests/s: mean over seeds, then min-max over "
        f"seeds; ratios over the seeds both arms ran. Default arm `{payload['default']}`. "
        "Bisection resolution "
        f"{100 * s['tie_resolution']:.1f}% of the rate: a ratio within that of 1 is a tie.",
        "",
        "| case | seeds | " + " | ".join(arms) + " | default / round robin | default / best |",
        "|---|---|" + "---|" * (len(arms) + 2),
    ]
    for case, cs in s["cases"].items():
        cells = " | ".join(
            f"{cs['mean'][a]:.1f} ({cs['min_max'][a][0]:.1f}-{cs['min_max'][a][1]:.1f})"
            if a in cs["mean"]
            else "-"
            for a in arms
        )
        counts = [len(seeds) for seeds in payload["goodput_rps"][case].values()]
        n = f"{min(counts)}-{max(counts)}" if min(counts) < max(counts) else str(max(counts))
        lines.append(
            f"| {case} | {n} | {cells} | {cs['default_vs_round_robin']:.3f} "
            f"({_range(cs['default_vs_round_robin_by_seed'])}) | "
            f"{cs['default_vs_best_arm']:.3f} ({_range(cs['default_vs_best_arm_by_seed'])}) |"
        )
    lines += [
        "",
        "Predicted-length arms over the strongest load-only arm, and arms over themselves "
        "without a prediction (`@none`), per seed paired:",
        "",
    ]
    lines += ["| case | strongest load-only | arm | mean ratio | by seed | verdict |"]
    lines += ["|---|---|---|---|---|---|"]
    for case, cs in s["cases"].items():
        for arm, v in cs.get("predicted_vs_strongest_load_only", {}).items():
            lines.append(
                f"| {case} | {cs['strongest_load_only']} | {arm} | {v['mean_ratio']:.3f} | "
                f"{_range(v['by_seed'])} | {v['verdict']} |"
            )
    for case, cs in s["cases"].items():
        for arm, v in cs.get("arm_vs_no_prediction", {}).items():
            lines.append(
                f"| {case} | {arm}@none (no prediction) | {arm} | {v['mean_ratio']:.3f} | "
                f"{_range(v['by_seed'])} | {v['verdict']} |"
            )
    lines += [
        "",
        f"default_vs_round_robin_min = {s['default_vs_round_robin_min']:.3f} (unequal cases, "
        f"ratio of means; per seed from {s['default_vs_round_robin_seed_min']:.3f}), "
        f"default_vs_best_arm_min = {s['default_vs_best_arm_min']:.3f} (per seed from "
        f"{s['default_vs_best_arm_seed_min']:.3f})",
    ]
    if payload.get("findings"):
        lines += ["", "## Findings", "", payload["findings"].strip()]
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = payload["summary"]["cases"]
    arms = payload["arms"]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(cases)), 4))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs = [j + i * width for j in range(len(cases))]
        mean = [cs["mean"].get(arm, 0.0) for cs in cases.values()]
        spans = [cs["min_max"].get(arm, [m, m]) for m, cs in zip(mean, cases.values(), strict=True)]
        lo = [m - span[0] for m, span in zip(mean, spans, strict=True)]
        hi = [span[1] - m for m, span in zip(mean, spans, strict=True)]
        ax.bar(xs, mean, width, yerr=[lo, hi], capsize=2, label=arm)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], list(cases), rotation=10)
    ax.set_ylabel("goodput at the SLO (req/s; bars: min-max over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render(payload: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(payload, indent=2) + "\n")
    if payload.get("summary"):
        (out / "routing.md").write_text(markdown(payload))
        plot(payload, out / "routing.png")


def _tie(part: dict[str, Any]) -> float:
    """The bisection's resolution of a study or a merged report; from its command where it
    predates those keys."""
    if "tie_resolution" in part:
        return float(part["tie_resolution"])
    if "bisection_steps" in part:
        return resolution(part["grow"], part["bisection_steps"])
    words = (part.get("command") or part["commands"][0]).split()

    def flag(name: str, default: str) -> str:
        return words[words.index(name) + 1] if name in words else default

    return resolution(float(flag("--grow", "2.0")), int(flag("--bisection-steps", "4")))


def merge(parts: Sequence[dict[str, Any]], findings: str = "") -> dict[str, Any]:
    """Studies of the same default, SLO and bisection over different cases, as one."""
    first = parts[0]
    for p in parts[1:]:
        for key in ("default", "slo"):
            if p[key] != first[key]:
                raise ValueError(f"studies differ in {key}: {p[key]} vs {first[key]}")
    table: Table = {}
    for p in parts:  # arms of one case may come from several studies
        for case, arms in p["goodput_rps"].items():
            for arm, seeds in arms.items():
                table.setdefault(case, {}).setdefault(arm, {}).update(seeds)
    arms = list(dict.fromkeys(a for p in parts for a in p["arms"]))
    tie = max(_tie(p) for p in parts)
    complete = {c: a for c, a in table.items() if first["default"] in a}
    payload = {
        "commands": [c for p in parts for c in p.get("commands", [p.get("command", "")])],
        "slo": first["slo"],
        "default": first["default"],
        "arms": arms,
        "cases": {c: d for p in parts for c, d in p["cases"].items()},
        "goodput_rps": table,
        "summary": summarize(complete, first["default"], tie) if complete else {},
        "complete": all(p.get("complete", False) for p in parts),
        "runs": {k: v for p in parts for k, v in p["runs"].items()},
        "wall_s": sum(p.get("wall_s", 0.0) for p in parts),
        "tie_resolution": tie,
        "findings": findings,
    }
    if payload["summary"]:
        keys = ("default_vs_round_robin_min", "default_vs_best_arm_min")
        payload |= {k: payload["summary"][k] for k in keys}
    return payload


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.study_report")
    parser.add_argument("studies", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--notes", type=Path, default=None, help="findings in words (markdown)")
    args = parser.parse_args(argv)
    parts = [json.loads(p.read_text()) for p in args.studies]
    notes = args.notes.read_text() if args.notes else ""
    render(merge(parts, notes), args.out)


if __name__ == "__main__":
    main()
