"""The results file (JSON) and its Markdown tables."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import machine, markdown_table
from bench.multisite.decision import DecisionTimes
from bench.multisite.metrics import BASELINE, CONFIGS, Cell, overall_kv_reduction, ratio, reduction
from bench.multisite.options import Options
from bench.multisite.workload import Workload

TIME_UNITS = (
    "Iterations are the primary time unit: a run's makespan is the largest number of engine "
    "iterations any site ran for it (what MICO reports). Wall clock, from the first submission "
    "to the last answer through the real gateway, is secondary: every site process and the "
    "gateway share this machine's CPU cores, so a site's step slows down as more sites are busy "
    "and as other work runs on the machine."
)
LABELS = {
    "rr_static": "RR+static",
    "rr_iter": "RR+iter",
    "tok_static": "tok+static",
    "mico": "MICO",
    "tok_static_batch": "tok+static (batch API)",
    "mico_batch": "MICO (batch API)",
}
MICO_TABLE1 = (
    "MICO's Table 1: 1.67x-2.22x query throughput for the full scheme vs round robin + static"
)


@dataclass
class Results:
    options: Options
    command: str
    predictions: dict[str, object]
    workload: Workload | None = None
    cells: list[Cell] = field(default_factory=list)
    scenarios: dict[str, object] | None = None
    bad_input: dict[str, object] | None = None
    decisions: list[DecisionTimes] = field(default_factory=list)
    batch_api: bool | None = None
    elapsed_s: float = 0.0


def _configs_present(cells: list[Cell]) -> list[str]:
    keys: list[str] = []
    for cell in cells:
        keys += [k for k in cell.runs if k not in keys]
    return keys


def per_config(cells: list[Cell]) -> dict[str, Any]:
    """Across all cells: cumulative KV reduction vs the baseline, mean/max imbalance."""
    keys = _configs_present(cells)
    return {
        "kv_cumulative_reduction": {
            k: round(overall_kv_reduction(cells, k), 4) for k in keys if k != BASELINE
        },
        "imbalance": {
            k: {
                "mean": round(
                    statistics.fmean(c.runs[k].imbalance for c in cells if k in c.runs), 4
                ),
                "max": round(max(c.runs[k].imbalance for c in cells if k in c.runs), 4),
            }
            for k in keys
        },
    }


def ablation(results: Results) -> dict[str, Any] | None:
    opts = results.options
    cell = next(
        (
            c
            for c in results.cells
            if (c.sites, c.max_batch) == (opts.ablation_sites, opts.ablation_max_batch)
        ),
        None,
    )
    if cell is None or "ablation" not in opts.phases:
        return None
    base = cell.runs[BASELINE]

    def arm(key: str) -> dict[str, Any] | None:
        run = cell.runs.get(key)
        if run is None:
            return None
        return {
            "config": key,
            "ratio_vs_rr_static": round(
                ratio(base.makespan_iterations, run.makespan_iterations), 4
            ),
            "ratio_vs_rr_static_wall": round(ratio(base.wall_s, run.wall_s), 4),
            "makespan_iterations": run.makespan_iterations,
            "imbalance": round(run.imbalance, 4),
            "kv_cumulative_reduction": round(reduction(base.kv_tokens, run.kv_tokens), 4),
        }

    real = opts.predictor_dir is not None
    return {
        "cell": {"sites": cell.sites, "max_batch": cell.max_batch, "queries": cell.queries},
        "real": arm("mico") if real else None,
        "oracle": arm("mico_oracle" if real else "mico"),
        "real_batch": arm("mico_batch") if real else None,
        "oracle_batch": arm("mico_batch_oracle" if real else "mico_batch"),
        "none": arm("mico_prompt_only"),
        "none_batch": arm("mico_batch_prompt_only"),
        "none_how": "a gateway without a predictor and GATEWAY_PLAN_WITHOUT_PREDICTION="
        "prompt_only: routing weighs prompt tokens alone (planning with max_tokens would be the "
        "oracle here, since the replay sends the true length as max_tokens)",
        "least_requests": arm("least_requests"),
        "rr_iter": arm("rr_iter"),
        "real_missing_why": None
        if real
        else "no predictor artifact: run `make predictor-default`, then this benchmark again",
    }


def payload(results: Results) -> dict[str, Any]:
    cells = results.cells
    body: dict[str, Any] = {
        "mico_reference": MICO_TABLE1,
        "time_units": TIME_UNITS,
        "predictions": results.predictions,
        "workload": results.workload.describe() if results.workload else None,
        "grid": {
            "cells": [
                {"max_batch": batch, "sites": list(sites)} for batch, sites in results.options.grid
            ],
            "queries": results.options.queries,
            "submission": "one burst: every query sent at once to /v1/completions; the *_batch "
            "columns send the same queries as one /v1/batches job (group-wise MICO assignment)",
            "batch_api_served": results.batch_api,
        },
        "configs": {c.key: c.label for c in CONFIGS},
        "table1": [cell.row() for cell in cells],
        **per_config(cells),
        "predictor_ablation": ablation(results),
        "scenarios": results.scenarios,
        "bad_input": results.bad_input,
        "decision_times": [d.to_json() for d in results.decisions],
        "decision_p99_ms": max((d.p99_ms for d in results.decisions), default=None),
        "elapsed_s": round(results.elapsed_s, 1),
    }
    return body


def _table1_markdown(cells: list[Cell]) -> str:
    shown = [
        k
        for k in ("rr_iter", "tok_static", "mico", "tok_static_batch", "mico_batch")
        if all(k in cell.runs for cell in cells)
    ]
    rows = [
        (
            cell.sites,
            cell.max_batch,
            cell.queries,
            *(f"{cell.speedup(k):.2f} / {cell.speedup_wall(k):.2f}" for k in shown),
            *(f"{cell.kv_cut(k):.1%}" for k in shown),
            " / ".join(f"{cell.runs[k].imbalance:.2f}" for k in (BASELINE, *shown)),
        )
        for cell in cells
    ]
    return markdown_table(
        (
            "sites",
            "max batch",
            "queries",
            *(LABELS[k] for k in shown),
            *(f"KV cut {LABELS[k]}" for k in shown),
            "imbalance " + " / ".join(LABELS[k] for k in (BASELINE, *shown)),
        ),
        rows,
    )


def markdown(results: Results, body: dict[str, Any]) -> str:
    parts = [
        f"Predictions: **{body['predictions']['mode']}**: {body['predictions']['note']}.",
        f"Workload: {json.dumps(body['workload'])}",
        f"Time: {TIME_UNITS}",
    ]
    if results.cells:
        mico = [cell.speedup("mico") for cell in results.cells]
        batch = [cell.speedup("mico_batch") for cell in results.cells if "mico_batch" in cell.runs]
        parts += [
            "## Table 1: throughput vs round robin + static batching",
            "Each cell is `ratio in iterations / ratio in wall clock`, a ratio being the "
            "baseline's makespan over the configuration's (higher is better; the queries are "
            "the same, so it is the throughput ratio). KV cut: cumulative KV use (tokens cached, "
            "summed over iterations and sites) saved vs the baseline. Imbalance: max/mean of "
            "the tokens (prompt + answer) served per site.",
            _table1_markdown(results.cells),
            f"MICO (token-balanced + iteration) vs round robin + static, in iterations: "
            f"{min(mico):.2f}x-{max(mico):.2f}x (mean {statistics.fmean(mico):.2f}x); "
            f"{MICO_TABLE1}."
            + (
                f" Through the batch API: {min(batch):.2f}x-{max(batch):.2f}x "
                f"(mean {statistics.fmean(batch):.2f}x)."
                if batch
                else ""
            ),
            "Cumulative KV reduction over all cells: "
            + ", ".join(f"{k} {v:.1%}" for k, v in body["kv_cumulative_reduction"].items()),
        ]
    ablation_body = body["predictor_ablation"]
    if ablation_body:
        arms = [
            (name, ablation_body[name])
            for name in (
                "real",
                "oracle",
                "real_batch",
                "oracle_batch",
                "none",
                "none_batch",
                "least_requests",
                "rr_iter",
            )
            if ablation_body.get(name)
        ]
        parts += [
            f"## Predictor ablation ({json.dumps(ablation_body['cell'])})",
            markdown_table(
                ("arm", "config", "ratio (iter)", "ratio (wall)", "imbalance", "KV cut"),
                [
                    (
                        name,
                        a["config"],
                        a["ratio_vs_rr_static"],
                        a["ratio_vs_rr_static_wall"],
                        a["imbalance"],
                        f"{a['kv_cumulative_reduction']:.1%}",
                    )
                    for name, a in arms
                ],
            ),
            f"No predictor (none, none_batch): {ablation_body['none_how']}.",
        ]
    if results.scenarios:
        parts += ["## Scenarios", _scenarios_markdown(results.scenarios)]
    if results.decisions:
        parts += [
            "## Routing decision time at 9 sites (predictor excluded)",
            markdown_table(
                ("policy", "decisions", "p50 ms", "p99 ms", "max ms"),
                [(d.policy, d.decisions, d.p50_ms, d.p99_ms, d.max_ms) for d in results.decisions],
            ),
        ]
    if results.bad_input:
        checks = results.bad_input["checks"]
        assert isinstance(checks, list)
        parts += [
            f"## Bad input (batch API: {results.bad_input['batch_api']})",
            markdown_table(
                ("check", "expected", "got", "error code", "nothing created", "passed"),
                [
                    (
                        c["check"],
                        c["expected_status"],
                        c["status"],
                        c["error_code"],
                        c["unchanged"],
                        c["passed"],
                    )
                    for c in checks
                ],
            ),
        ]
    parts.append(f"Benchmark time: {results.elapsed_s / 60:.1f} min.")
    return "\n\n".join(parts)


def _scenarios_markdown(scenarios: dict[str, Any]) -> str:
    rows = []
    for name in ("skewed", "unequal_capacity"):
        s = scenarios.get(name)
        if not s:
            continue
        # Unequal sites should carry load in proportion to capacity: compare per unit of it.
        shares = s.get("imbalance_per_capacity", s["imbalance"])
        for key, speedup in s["speedup_iterations"].items():
            rows.append(
                (
                    name,
                    f"{LABELS.get(key, key)} vs RR+iter",
                    f"{speedup:.2f}",
                    f"{s['speedup_wall'][key]:.2f}",
                    f"{shares['rr_iter']:.2f} / {shares[key]:.2f}",
                    "",
                )
            )
    slowed = scenarios.get("slowed_site")
    if slowed:
        rows.append(
            (
                f"slowed site ({slowed['speed_while_slowed']:.0%} speed)",
                "RR, offload on vs off",
                f"{slowed['offload_gain_iterations']:.2f}",
                f"{slowed['offload_gain_wall']:.2f}",
                "",
                f"{slowed['moved_requests']} moved",
            )
        )
    loss = scenarios.get("site_loss")
    if loss:
        rows.append(
            (
                "site killed mid-run",
                "RR, offload on",
                "",
                "",
                "",
                f"{loss['completed']}/{loss['queries']} completed "
                f"({loss['restarted_elsewhere']} restarted elsewhere), "
                f"{loss['failed_while_queued']} lost while queued, "
                f"{loss['failed_mid_answer']} mid-answer",
            )
        )
    return markdown_table(
        (
            "scenario",
            "comparison",
            "speed-up (iter)",
            "speed-up (wall)",
            "imbalance RR / other (unequal: per unit of capacity)",
            "moves / losses",
        ),
        rows,
    )


def write(results: Results) -> Path:
    """NAME.json and NAME.md in the output folder, stamped with the command and the machine."""
    body = payload(results)
    stamped = {
        "command": results.command,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        **body,
    }
    out = results.options.out_dir
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{results.options.name}.json"
    json_path.write_text(json.dumps(stamped, indent=2) + "\n")
    (out / f"{results.options.name}.md").write_text(
        f"# {results.options.name}\n\nCommand: `{results.command}`\n\n"
        f"Machine: {stamped['machine']}\n\n{markdown(results, body)}\n"
    )
    return json_path
