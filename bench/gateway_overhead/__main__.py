"""`python -m bench.gateway_overhead`: fedllm's gateway (SQLite, then PostgreSQL) and the
LiteLLM anchor through ../shared/gwbench, back to back, into
bench/results/gateway_overhead/gateway_overhead.{json,md}.

    python -m bench.gateway_overhead [--gwbench ../shared/gwbench]
        [--predictor DIR | --no-predictor] [--databases sqlite postgres] [--no-anchor]
        [--checkout DIR] [--reps 1] [--rounds 1] [--concs "1 32"] [--n-c1 300]
        [--n-high 1500] [--duration 30] [--out bench/results/gateway_overhead]

`--rounds R` measures fedllm then LiteLLM R times in turn, each pair within about two minutes:
the shared vCPU's speed moves by up to 2x within minutes, which one pair of runs minutes apart
takes for a change of the gateway's. Each round's ratio is reported; the figures and goals are
the round with the median non-stream ratio.

Needs /tmp/gwbench/venv (aiohttp, uvloop) and /tmp/gwbench/litellm-venv (litellm[proxy]==1.106.2)
as the kit's README sets them up, PostgreSQL on 127.0.0.1:5432 (user postgres) for the
PostgreSQL run, and a predictor artifact (`make predictor-default`: var/predictor/default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import results_dir
from bench.gateway_overhead.fedllm import Kit, run_fedllm
from bench.gateway_overhead.report import figures, goals, markdown

ROOT = Path(__file__).resolve().parents[2]


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the fedllm measured")
    parser.add_argument("--gwbench", type=Path, default=ROOT.parent / "shared" / "gwbench")
    parser.add_argument("--tokenizer", type=Path, default=ROOT.parent / "shared/tokenizers/gpt2")
    parser.add_argument("--predictor", type=Path, default=ROOT / "var" / "predictor" / "default")
    parser.add_argument("--no-predictor", action="store_true")
    parser.add_argument("--routing", default="mico")
    parser.add_argument("--databases", nargs="*", default=["sqlite", "postgres"])
    parser.add_argument("--no-anchor", action="store_true", help="fedllm only")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="fedllm/LiteLLM pairs in turn")
    parser.add_argument("--concs", default="1 32")
    parser.add_argument("--n-c1", type=int, default=300)
    parser.add_argument("--n-high", type=int, default=1500)
    parser.add_argument("--duration", type=int, default=30)
    parser.add_argument("--out", type=Path, default=results_dir("gateway_overhead"))
    parser.add_argument("--tag", default="gateway_overhead", help="result file name")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a runs folder (fedllm-sqlite/, litellm/) measured before, shown for comparison",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the report from <tag>.json"
    )
    return parser.parse_args(argv)


def _anchor(kit: Kit, out: Path) -> None:
    env = os.environ | {"OUT": str(out.resolve()), "NETCHECK": "0"}
    with (out.parent / f"{out.name}.out").open("w") as log:
        subprocess.run(
            [str(kit.gwbench / "run_anchor.sh")],
            check=True,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _summary(out: Path) -> list[dict[str, Any]]:
    return list(json.loads((out / "summary.json").read_text()))


def _measure(
    args: argparse.Namespace, kit: Kit, runs_dir: Path, high: int
) -> dict[str, dict[str, Any]]:
    """fedllm on each database, then LiteLLM, back to back."""
    runs: dict[str, dict[str, Any]] = {}
    for database in args.databases:
        out = runs_dir / f"fedllm-{database}"
        print(f"fedllm on {database} -> {out}", flush=True)
        extra = run_fedllm(args.checkout.resolve(), out, kit, database)
        runs[f"fedllm-{database}"] = extra | {"figures": figures(_summary(out), high)}
    if not args.no_anchor:
        out = runs_dir / "litellm"
        out.mkdir(parents=True, exist_ok=True)
        print(f"LiteLLM anchor -> {out}", flush=True)
        _anchor(kit, out)
        runs["litellm-1.106.2"] = {"figures": figures(_summary(out), high)}
    return runs


def _ratios(verdicts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: {mode: v["rps_ratio_vs_litellm"] for mode, v in verdict.items()}
        for name, verdict in verdicts.items()
    }


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose first fedllm's non-stream ratio is the median (the lower of the middle
    two for an even count); the only round when there is one or no anchor ran."""

    def ratio(r: dict[str, Any]) -> float:
        verdicts = list(r["goals"].values())
        return (verdicts[0]["non_stream"]["rps_ratio_vs_litellm"] or 0.0) if verdicts else 0.0

    ordered = sorted(rounds, key=ratio)
    return ordered[(len(ordered) - 1) // 2]


def _baseline(folder: Path, high: int) -> dict[str, Any]:
    runs = {}
    for name, sub in (("fedllm-sqlite", "fedllm-sqlite"), ("litellm-1.106.2", "litellm")):
        if (folder / sub / "summary.json").is_file():
            runs[name] = {"figures": figures(_summary(folder / sub), high)}
    meta = json.loads((folder / "fedllm-sqlite" / "meta.json").read_text())
    return {
        "label": folder.name,
        "how": f"`{os.path.relpath(folder, ROOT)}`: the same kit and matrix (reps "
        f"{meta['reps']}, c {meta['concs']}), measured back to back before the change.",
        "runs": runs,
    }


def _write(result: dict[str, Any], out: Path, tag: str) -> None:
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{tag}.md").write_text(markdown(result))
    print(markdown(result))


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.report_only:
        result = json.loads((args.out / f"{args.tag}.json").read_text())
        if args.baseline is not None:
            result["baseline"] = _baseline(args.baseline.resolve(), result["high_concurrency"])
        _write(result, args.out, args.tag)
        return 0
    predictor = None if args.no_predictor else args.predictor.resolve()
    if predictor is not None and not predictor.is_dir():
        sys.exit(f"no predictor artifact at {predictor} (make predictor-default, or --predictor)")
    kit = Kit(args.gwbench.resolve(), args.tokenizer.resolve(), predictor, args.routing)
    os.environ.update(
        REPS=str(args.reps),
        CONCS=args.concs,
        N_C1=str(args.n_c1),
        N_HIGH=str(args.n_high),
        DURATION=str(args.duration),
    )
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    base_dir = args.out.resolve() / "gateway_overhead_runs" / stamp
    high = max(int(c) for c in args.concs.split())
    rounds: list[dict[str, Any]] = []
    for index in range(max(args.rounds, 1)):
        runs_dir = base_dir if args.rounds <= 1 else base_dir / f"round-{index + 1}"
        runs = _measure(args, kit, runs_dir, high)
        anchor = runs.get("litellm-1.106.2")
        verdicts = {
            name: goals(run["figures"], anchor["figures"], high)
            for name, run in runs.items()
            if name.startswith("fedllm") and anchor
        }
        rounds.append(
            {"runs_dir": os.path.relpath(runs_dir, ROOT), "runs": runs, "goals": verdicts}
        )
    median = _median_round(rounds)
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.gateway_overhead " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other work)",
        "reps": args.reps,
        "concs": args.concs,
        "n_c1": args.n_c1,
        "n_high": args.n_high,
        "predictor": str(predictor) if predictor else "off",
        "routing": args.routing,
        "high_concurrency": high,
        "runs_dir": median["runs_dir"],
        "runs": median["runs"],
        "goals": median["goals"],
    }
    if len(rounds) > 1:
        result["rounds"] = [
            {"runs_dir": r["runs_dir"], "ratios": _ratios(r["goals"])} for r in rounds
        ]
    if args.baseline is not None:
        result["baseline"] = _baseline(args.baseline.resolve(), high)
    _write(result, args.out, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
