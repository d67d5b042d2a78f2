"""`python -m bench.elastic.summary --name NAME RESULT.json ...`: the keys of several seeds' results
(each one `python -m bench.elastic` file holding the autoscaled and static2 arms under the same 1x)
side by side, with their min and max. A goal counts as met only if the worst seed meets it: one
seed inside the noise is no result (the developers' guide)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import markdown_table, results_dir
from bench.elastic.report import GOALS

ARM_FIGURES = ("slo_attainment", "site_seconds", "lost", "requests")


def summarize(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per key: each seed's value, the min and the max, and whether the worst one meets the goal."""
    units = {float(r["unit_rps"]) for r in results.values()}
    if len(units) != 1:
        raise ValueError(f"the results were run at different 1x rates: {sorted(units)}")
    keys: dict[str, Any] = {}
    for key, (how, goal) in GOALS.items():
        values = {name: r.get(key) for name, r in results.items()}
        known = [v for v in values.values() if v is not None]
        low, high = (min(known), max(known)) if known else (None, None)
        worst = low if how == ">=" else high
        met = (
            None
            if worst is None or len(known) < len(values)
            else (worst >= goal if how == ">=" else worst <= goal)
        )
        keys[key] = {"by_seed": values, "min": low, "max": high, "goal": f"{how} {goal}",
                     "met_by_every_seed": met}  # fmt: skip
    arms: dict[str, dict[str, Any]] = {}
    for name, result in results.items():
        for arm, figures in result["arms"].items():
            arms.setdefault(arm, {})[name] = {f: figures.get(f) for f in ARM_FIGURES}
    first = next(iter(results.values()))
    return {
        "unit_rps": units.pop(),
        "preset": first["preset"],
        "phases": first["phases"],
        "slo": first["slo"],
        "seeds": {name: r.get("seed") for name, r in results.items()},
        "keys": keys,
        "arms": arms,
        "commands": list(dict.fromkeys(c for r in results.values() for c in r.get("commands", []))),
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def markdown(summary: Mapping[str, Any]) -> str:
    names = list(summary["seeds"])
    phases = " -> ".join(f"{p['multiple']:g}x {p['seconds']:g}s" for p in summary["phases"])
    key_rows = [
        [key, *(k["by_seed"][n] for n in names), k["min"], k["max"], k["goal"],
         k["met_by_every_seed"]]
        for key, k in summary["keys"].items()
    ]  # fmt: skip
    arm_rows = [
        [arm, n, *(by_seed[n][f] for f in ARM_FIGURES)]
        for arm, by_seed in summary["arms"].items()
        for n in names
        if n in by_seed
    ]
    lines = [
        f"# Elastic capacity over {len(names)} seeds: preset {summary['preset']}",
        "",
        f"Load {phases} (1x = {summary['unit_rps']} req/s); SLO TTFT <= "
        f"{summary['slo']['ttft_s']}s and TPOT <= {summary['slo']['tpot_s']}s per request. "
        "A goal is met only if every seed meets it.",
        "",
        "## Keys (autoscaled against static 2 sites)",
        "",
        markdown_table(["key", *names, "min", "max", "goal", "met"], key_rows),
        "",
        "## Arms",
        "",
        markdown_table(["arm", "seed file", *ARM_FIGURES], arm_rows),
        "",
        "## Commands",
        "",
        *(f"- `{c}`" for c in summary["commands"]),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.elastic.summary", description=__doc__)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--name", required=True, help="the summary's file name, no suffix")
    parser.add_argument("--out-dir", type=Path, default=results_dir("elastic"))
    args = parser.parse_args(argv)
    results = {path.stem: json.loads(path.read_text()) for path in args.results}
    try:
        summary = summarize(results)
    except ValueError as exc:
        parser.error(str(exc))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out_dir / f"{args.name}.md").write_text(markdown(summary))
    print(args.out_dir / f"{args.name}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
