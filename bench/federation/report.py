"""The result files: NAME.json (every run, goodput per arm and its ratio to least_requests),
NAME.md (the tables) and NAME.png (TTFT and end-to-end p99 against the rate, one line per arm)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
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
from bench.multisite.decision import time_decisions

BASELINE = "least_requests"
# The federation's own policy (with the predictor, with true lengths) and the peers' arms it is
# compared with (goodput_vs_best_peer).
OURS = ("completion_cost", "completion_cost_oracle")
PEERS = ("sglang_router", "prefix_affinity", "dynamo_cost")


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
    peers = [goodput[arm] for arm in PEERS if arm in goodput]
    best_peer = max(peers, default=0.0)
    return {
        "slo": {"ttft_p99_s": TTFT_SLO_S, "tpot_p99_s": TPOT_SLO_S, "network": "included"},
        "goodput_rps": goodput,
        "goodput_vs_least_requests": {arm: ratio(g, base) for arm, g in goodput.items()},
        "goodput_vs_best_peer": {
            arm: ratio(goodput[arm], best_peer) for arm in OURS if arm in goodput and peers
        },
        "rates_run": {arm: [run["rate_rps"] for run in arm_runs] for arm, arm_runs in runs.items()},
        # The prefix-reuse runs (they count each site's requests themselves).
        "at_goodput": {
            arm: _at_goodput(arm_runs, goodput[arm])
            for arm, arm_runs in runs.items()
            if any("site_requests" in run for run in arm_runs)
        },
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


def _at_goodput(runs: Sequence[Mapping[str, Any]], goodput: float) -> dict[str, Any]:
    """An arm at its goodput rate (its lowest rate when it held none): latency, hit rates and
    where its requests went."""
    chosen = [run for run in runs if run["rate_rps"] == goodput] or sorted(
        runs, key=lambda run: run["rate_rps"]
    )[:1]
    if not chosen:
        return {}
    run = chosen[0]
    sites = run.get("site_requests") or run.get("requests_per_site", {})
    total = sum(sites.values())
    return {
        "rate_rps": run["rate_rps"],
        "ttft_s": run["ttft_s"],
        "hit_rate_simulated": run.get("hit_rate_simulated", {}).get("all"),
        "hit_rate_measured": run.get("hit_rate_measured"),
        "request_share_per_site": {k: round(v / total, 3) for k, v in sites.items()}
        if total
        else {},
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def _answered(run: Mapping[str, Any]) -> str:
    streaming = run.get("cut_off_streaming") or 0  # absent from results before the rule
    return f"{run['completed']}/{run['requests']}" + (f" (+{streaming})" if streaming else "")


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
                        _answered(run),
                        _s(run["ttft_s"]["p50"]),
                        _s(run["ttft_s"]["p99"]),
                        _s(run["e2e_s"]["p50"]),
                        _s(run["e2e_s"]["p99"]),
                        _ms(run["tpot_s"]["p99"]),
                        run["slo_attained_rps"],
                        "yes" if run["holds_slo"] else "no",
                    ]
                )
        header = ["arm", "rate rps", "ok (+streaming at the cut)", "TTFT p50 s", "TTFT p99 s"]
        header += ["e2e p50 s", "e2e p99 s", "TPOT p99 ms", "SLO-met rps", "holds SLO"]
        parts.append(
            "## Per arm and rate\n\nA request still streaming when the drain ended counts with "
            "its TTFT and its TPOT until the cut (bench/federation/metrics.py); e2e counts "
            "finished requests only.\n\n" + markdown_table(header, rows)
        )
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
    if sweep and sweep.get("at_goodput"):
        parts.append(_reuse_table(sweep))
    if payload.get("adaptation"):
        parts.append(_adaptation(payload["adaptation"]))
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
        rows = [
            [d["policy"], d["sites"], d["p50_ms"], d["p99_ms"], d.get("cpu_p99_ms", "-")]
            for d in decision
        ]
        parts.append(
            "## Routing decision time (9 sites; prefix indexes of 1M blocks together)\n\n"
            "CPU p99: the deciding thread's own time (wall time counts another process's turn "
            "on a shared core).\n\n"
            + markdown_table(["policy", "sites", "p50 ms", "p99 ms", "CPU p99 ms"], rows)
        )
    return "\n\n".join(parts)


def _adaptation(adaptation: Mapping[str, Any]) -> str:
    """What the retrain-from-served-traffic path made of the train split (adapt.py)."""
    scores = adaptation["offline_on_test_split"]
    keys = ("spearman", "mae_tokens", "mean_expected")
    rows = [[name, *(row[k] for k in keys)] for name, row in scores.items()]
    said = "\n".join(f"    {line}" for line in adaptation["retrain_output"])
    return (
        f"## The predictor adapted from served traffic\n\n{adaptation['answered']} of "
        f"{adaptation['served_requests']} train-split requests answered through a gateway with "
        f"the base predictor ({adaptation['base']}), then `gateway.retrain_predictor --mode "
        f"{adaptation['mode']}` on its samples ({adaptation['seconds']:g} s in all). The "
        "completion_cost_adapted arm serves the candidate whatever the gate said; the gate "
        f"(its last lines):\n\n{said}\n\nOn the measured test split's prompts, against the "
        "lengths the sites replay:\n\n"
        + markdown_table(["predictor", "Spearman", "MAE tokens", "mean expected"], rows)
    )


def _reuse_table(sweep: Mapping[str, Any]) -> str:
    rows = []
    for arm, at in sweep["at_goodput"].items():
        if not at:
            continue
        measured = at.get("hit_rate_measured") or {}
        known = [v for v in measured.values() if v is not None]
        rows.append(
            [
                arm,
                sweep["goodput_rps"][arm],
                sweep["goodput_vs_least_requests"][arm],
                sweep.get("goodput_vs_best_peer", {}).get(arm, "-"),
                " ".join(f"{r:g}" for r in sweep["rates_run"][arm]),
                at["rate_rps"],
                _s(at["ttft_s"]["p50"]),
                _s(at["ttft_s"].get("p90")),
                "-" if at["hit_rate_simulated"] is None else at["hit_rate_simulated"],
                " ".join(f"{v:g}" for v in known) if known else "n/a",
                " ".join(f"{k}={v}" for k, v in at["request_share_per_site"].items()),
            ]
        )
    header = ["arm", "goodput rps", "vs least_requests", "vs best peer", "rates run"]
    header += ["at rate", "TTFT p50 s", "TTFT p90 s", "hit (simulated LRU)"]
    header += ["hit (sites' counters)", "requests per site"]
    return (
        "## Per arm at its goodput rate (prefix reuse)\n\n"
        "Hit rates are shares of prompt tokens: simulated = an LRU of each site's KV capacity fed "
        "what the arm sent it (SGLang's router does not say where a request went: -); sites' "
        "counters = the engines' own prefix-cache hits over the run, per site that served any "
        "(n/a: no site exports prefix-cache counters).\n\n" + markdown_table(header, rows)
    )


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
        if stored["sweep"].get("goodput_vs_best_peer"):
            stored["goodput_vs_best_peer"] = stored["sweep"]["goodput_vs_best_peer"]
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


def finish(
    options_phases: frozenset[str],
    decisions: int,
    out_dir: Path,
    name: str,
    command: str,
    payload: dict[str, Any],
    elapsed_s: float,
    log: Callable[[str], None],
) -> Path:
    """The decision-time phase when asked (9 sites, prefix indexes of 1M blocks), then the
    result files."""
    if "decision" in options_phases:
        log("routing decision time, 9 sites")
        payload["decision_time_ms"] = [t.to_json() for t in time_decisions(9, decisions)]
    payload["elapsed_s"] = round(elapsed_s, 1)
    path = write(out_dir, name, command, payload, name)
    log(f"wrote {path} ({payload['elapsed_s']:.0f}s)")
    return path
