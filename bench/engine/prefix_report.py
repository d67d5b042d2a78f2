"""The prefix-caching benchmark's results files: JSON, a Markdown report and a PNG of the curves.

The GPU machine may lack matplotlib: the PNG is then left out, and
`python -m bench.engine.prefix_report bench/results/engine_prefix/engine_prefix_h100.json`
writes the Markdown and the PNG again from the JSON, here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import bench.common as common
from bench.common import markdown_table

# The goals, by result key: (workload, key, comparison, target).
GOALS = (
    ("shared", "prefill_computed_over_offered", "<=", 0.45),
    ("shared", "goodput_vs_no_cache", ">=", 1.8),
    ("trace", "computed_over_lru_bound", "<=", 1.05),
    ("trace", "host_tier_computed_over_offered", "<=", 0.6),
    # Issue 50: the host tier never costs the step.
    ("trace", "host_tier_ttft_p99_ratio_max", "<=", 1.0),
    ("trace", "host_goodput_vs_device", ">=", 1.0),
    ("noreuse", "throughput_vs_no_cache_no_reuse", ">=", 0.97),
)
_COLUMNS = (
    ("rate", "rate", 1),
    ("computed/offered", "prefill_computed_over_offered", 3),
    ("hit rate", "hit_rate", 3),
    ("host hits", "host_hit_rate", 3),
    ("TTFT p50 ms", "ttft_p50_ms", 0),
    ("TTFT p99 ms", "ttft_p99_ms", 0),
    ("TPOT p99 ms", "tpot_p99_ms", 1),
    ("out tok/s", "output_tok_s", 0),
    ("done", "completed", 0),
    ("preempted", "preemptions", 0),
)


def save(args: argparse.Namespace, name: str, payload: dict[str, Any], command: str) -> Path:
    path = common.write_results(name, payload, report(payload), command, Path(args.results_dir))
    if importlib.util.find_spec("matplotlib") is not None:
        plot(payload, path.with_suffix(".png"))
    return path


def _cell(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def report(payload: dict[str, Any]) -> str:
    workloads = payload.get("workloads", {})
    rows = []
    for workload, key, op, target in GOALS:
        if workload not in workloads:
            continue
        value = workloads[workload].get(key)
        held = None if value is None else (value <= target if op == "<=" else value >= target)
        verdict = "-" if held is None else ("met" if held else "not met")
        rows.append((workload, f"`{key}`", _cell(value, 3), f"{op} {target}", verdict))
    engine = payload.get("engine", {})
    parts = [
        f"Preset `{payload.get('preset')}`, clock: {payload.get('clock')}; "
        f"complete: {payload.get('complete')}.",
        f"Engine: {engine.get('kv_blocks_total')} device blocks of {engine.get('kv_block_size')} "
        f"tokens, {engine.get('host_kv_blocks')} host-tier blocks, {engine.get('max_num_seqs')} "
        f"sequences, {engine.get('max_num_batched_tokens')} tokens per step. SLO: TTFT p99 <= "
        f"{payload['slo']['ttft_p99_ms']:.0f} ms, TPOT p99 <= {payload['slo']['tpot_p99_ms']:.0f} "
        "ms, every request finished.",
        *(
            [
                "\nOn a step clock every engine step counts the same time, whatever it computes: "
                "rates, latencies and goodputs are in those virtual seconds and say nothing about "
                "speed. What this preset measures is the prompt tokens computed, which are "
                "deterministic (tests/unit/engine/test_bench_prefix_cpu.py checks them)."
            ]
            if str(payload.get("clock", "")).startswith("step")
            else []
        ),
        "\n## Goals\n",
        markdown_table(("workload", "result", "value", "goal", ""), rows),
    ]
    for workload, result in workloads.items():
        parts += _workload(workload, result)
    if payload.get("skipped"):
        parts += ["\n## Skipped (deadline)\n", *(f"- {s}" for s in payload["skipped"])]
    return "\n".join(parts)


def _workload(workload: str, result: dict[str, Any]) -> list[str]:
    parts = [f"\n## {workload}\n"]
    if workload == "trace":
        parts.append(result["how"] + ".\n")
        bounds = result["lru_bounds"]
        table = [
            (
                name,
                _cell(b["capacity_tokens"], 0) if b["capacity_tokens"] else "unbounded",
                _cell(b["computed_over_offered"], 3),
            )
            for name, b in bounds.items()
        ]
        header = ("LRU cache of", "capacity tokens", "computed/offered at best")
        parts.append(markdown_table(header, table))
        parts.append("")
    summary = [
        (key, _cell(value, 3))
        for key, value in result.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    ]
    summary += [(f"goodput ({arm})", _cell(rate, 1)) for arm, rate in result["goodput"].items()]
    parts += [markdown_table(("", "value"), summary), ""]
    for arm, rows in result["arms"].items():
        parts.append(f"\n### {workload}, {arm}\n")
        parts.append(
            markdown_table(
                [label for label, _, _ in _COLUMNS] + ["SLO"],
                [
                    [_cell(row.get(key), digits) for _, key, digits in _COLUMNS]
                    + ["held" if not row["misses"] else "; ".join(row["misses"])]
                    for row in rows
                ],
            )
        )
    return parts


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = payload.get("workloads", {})
    if not workloads:
        return
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    for column, (workload, result) in enumerate(workloads.items()):
        for arm, rows in result["arms"].items():
            rates = [row["rate"] for row in rows]
            axes[0][column].plot(rates, [row["ttft_p99_ms"] for row in rows], marker="o", label=arm)
            axes[1][column].plot(
                rates, [row["prefill_computed_over_offered"] for row in rows], marker="o", label=arm
            )
        axes[0][column].axhline(payload["slo"]["ttft_p99_ms"], color="grey", linestyle=":")
        axes[0][column].set_yscale("log")
        axes[0][column].set_title(f"{workload}: TTFT p99 (ms)")
        axes[1][column].set_title(f"{workload}: prompt tokens computed / offered")
        axes[1][column].set_ylim(0, 1.05)
        for axis in (axes[0][column], axes[1][column]):
            axis.set_xlabel("arrival rate")
            axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> None:
    """Markdown and PNG again from a results JSON (written next to it)."""
    path = Path(argv[0])
    payload = json.loads(path.read_text())
    markdown = report(payload)
    path.with_suffix(".md").write_text(
        f"# {path.stem}\n\nCommand: `{payload['command']}`\n\nMachine: {payload['machine']}"
        f"\n\n{markdown}\n"
    )
    plot(payload, path.with_suffix(".png"))


if __name__ == "__main__":
    main(sys.argv[1:])
