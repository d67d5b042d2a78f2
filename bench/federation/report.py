"""The result files: NAME.json (every run, goodput per arm and its ratio to least_requests),
NAME.md (the tables) and NAME.png (TTFT and end-to-end p99 against the rate, one line per arm)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import machine, markdown_table
from bench.federation.metrics import (
    TPOT_SLO_S,
    TTFT_SLO_S,
    RunSummary,
    goodput_rps,
    ratio,
    tokens_per_capacity,
)

BASELINE = "least_requests"


def sweep_payload(
    results: Mapping[str, Sequence[RunSummary]], weights: Mapping[str, float]
) -> dict[str, Any]:
    return derive_sweep(
        {arm: [run.to_json() for run in runs] for arm, runs in results.items()}, weights
    )


def derive_sweep(
    runs: Mapping[str, Sequence[Mapping[str, Any]]], weights: Mapping[str, float]
) -> dict[str, Any]:
    """The sweep's summary from its runs as stored in the JSON (so a stored result can be
    summarized again: `python -m bench.federation.render`)."""
    goodput = {
        arm: goodput_rps([(run["rate_rps"], run["holds_slo"]) for run in arm_runs])
        for arm, arm_runs in runs.items()
    }
    best_attained = {
        arm: round(max((run["slo_attained_rps"] for run in arm_runs), default=0.0), 3)
        for arm, arm_runs in runs.items()
    }
    base = goodput.get(BASELINE, 0.0)
    return {
        "slo": {"ttft_p99_s": TTFT_SLO_S, "tpot_p99_s": TPOT_SLO_S, "network": "included"},
        "goodput_rps": goodput,
        "goodput_vs_least_requests": {arm: ratio(g, base) for arm, g in goodput.items()},
        "best_slo_attained_rps": best_attained,
        "slo_attained_vs_least_requests": {
            arm: ratio(v, best_attained.get(BASELINE, 0.0)) for arm, v in best_attained.items()
        },
        "tokens_per_capacity_share": {
            arm: tokens_per_capacity([run["tokens_per_site"] for run in arm_runs], weights)
            for arm, arm_runs in runs.items()
        },
        "runs": {arm: list(arm_runs) for arm, arm_runs in runs.items()},
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(payload: Mapping[str, Any]) -> str:
    parts: list[str] = []
    sweep = payload.get("sweep")
    if sweep:
        rows = []
        for arm, runs in sweep["runs"].items():
            for run in runs:
                rows.append(
                    [
                        arm,
                        run["rate_rps"],
                        f"{run['completed']}/{run['requests']}",
                        _s(run["ttft_s"]["p50"]),
                        _s(run["ttft_s"]["p99"]),
                        _s(run["e2e_s"]["p50"]),
                        _s(run["e2e_s"]["p99"]),
                        _ms(run["tpot_s"]["p99"]),
                        run["slo_attained_rps"],
                        "yes" if run["holds_slo"] else "no",
                    ]
                )
        header = ["arm", "rate rps", "ok", "TTFT p50 s", "TTFT p99 s", "e2e p50 s", "e2e p99 s"]
        header += ["TPOT p99 ms", "SLO-met rps", "holds SLO"]
        parts.append("## Per arm and rate\n\n" + markdown_table(header, rows))
        goodput_rows = [
            [
                arm,
                sweep["goodput_rps"][arm],
                sweep["goodput_vs_least_requests"][arm],
                sweep["best_slo_attained_rps"][arm],
                sweep["slo_attained_vs_least_requests"][arm],
                " ".join(f"{k}={v}" for k, v in sweep["tokens_per_capacity_share"][arm].items()),
            ]
            for arm in sweep["goodput_rps"]
        ]
        parts.append(
            f"## Goodput (TTFT p99 <= {TTFT_SLO_S:g} s, TPOT p99 <= {1000 * TPOT_SLO_S:.0f} ms, "
            "network included)\n\n"
            + markdown_table(
                [
                    "arm",
                    "goodput rps (highest rate holding the SLO)",
                    "vs least_requests",
                    "best SLO-met rps",
                    "vs least_requests",
                    "tokens per unit of capacity, share of the mean (over the sweep)",
                ],
                goodput_rows,
            )
        )
    for title, key in (("Slowed site", "slowed_site"), ("Killed site", "killed_site")):
        scenario = payload.get("scenarios", {}).get(key)
        if scenario:
            runs = scenario.get("runs") or [scenario["run"]]
            rows = [
                [
                    run["arm"],
                    f"{run['completed']}/{run['requests']}",
                    _s(run["ttft_s"]["p99"]),
                    _s(run["e2e_s"]["p99"]),
                    _ms(run["tpot_s"]["p99"]),
                    run["slo_attained_rps"],
                    run.get("offloads", 0),
                    run.get("failovers", 0),
                ]
                for run in runs
            ]
            head = ["run", "ok", "TTFT p99 s", "e2e p99 s", "TPOT p99 ms", "SLO-met rps"]
            head += ["offloads", "failovers"]
            facts = {k: v for k, v in scenario.items() if k not in ("runs", "run")}
            parts.append(f"## {title}\n\n{facts}\n\n" + markdown_table(head, rows))
    decision = payload.get("decision_time_ms")
    if decision:
        rows = [[d["policy"], d["sites"], d["p50_ms"], d["p99_ms"]] for d in decision]
        parts.append(
            "## Routing decision time (9 sites)\n\n"
            + markdown_table(["policy", "sites", "p50 ms", "p99 ms"], rows)
        )
    return "\n\n".join(parts)


def plot(payload: Mapping[str, Any], path: Path, title: str) -> Path | None:
    sweep = payload.get("sweep")
    if not sweep:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, grid = plt.subplots(2, 2, figsize=(13, 9))
    axes = grid.flatten()
    panels = (
        ("ttft_s", "TTFT p99 (s)", TTFT_SLO_S),
        ("e2e_s", "end-to-end p99 (s)", None),
        ("tpot_s", "TPOT p99 (s)", TPOT_SLO_S),
    )
    for axis, (key, label, slo) in zip(axes[:3], panels, strict=True):
        for arm, runs in sweep["runs"].items():
            rates = [run["rate_rps"] for run in runs]
            values = [run[key]["p99"] if run[key]["p99"] is not None else math.nan for run in runs]
            axis.plot(rates, values, marker="o", label=arm)
        if slo is not None:
            axis.axhline(slo, color="grey", linestyle="--", linewidth=1, label="SLO")
        axis.set(xlabel="offered load (requests/s)", ylabel=label, yscale="log")
        axis.grid(True, alpha=0.3)
    for arm, runs in sweep["runs"].items():
        axes[3].plot(
            [run["rate_rps"] for run in runs],
            [run["slo_attained_rps"] for run in runs],
            marker="o",
            label=arm,
        )
    axes[3].set(xlabel="offered load (requests/s)", ylabel="requests meeting the SLO per s")
    axes[3].grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def with_headline(stored: dict[str, Any]) -> dict[str, Any]:
    """The result with the sweep's goodput ratios also at the top level, where release checks
    read them (`goodput_vs_least_requests`: arm -> ratio, from the same run)."""
    if "sweep" in stored:
        stored["goodput_vs_least_requests"] = stored["sweep"]["goodput_vs_least_requests"]
    return stored


def write(out_dir: Path, name: str, command: str, payload: dict[str, Any], title: str) -> Path:
    stamped = with_headline(
        {
            "command": command,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            **payload,
        }
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(stamped, indent=2, allow_nan=False) + "\n")
    write_pages(json_path, stamped, title)
    return json_path


def write_pages(json_path: Path, stored: Mapping[str, Any], title: str) -> None:
    """NAME.png and NAME.md next to NAME.json, from the stored result."""
    png = plot(stored, json_path.with_suffix(".png"), title)
    figure = f"![latency vs rate]({png.name})\n\n" if png else ""
    json_path.with_suffix(".md").write_text(
        f"# {json_path.stem}\n\n{stored.get('label', '')}\n\nCommand: `{stored['command']}`\n\n"
        f"Machine: {stored['machine']}\n\n{figure}{markdown(stored)}\n"
    )
