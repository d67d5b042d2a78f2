"""The markdown and the figure of bench/engine/lora.py's results."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import markdown_table

# The headline keys, and whether lower is better (the worst seed is the highest then).
HEADLINE = {"decode_step_vs_base": True, "tpot_p50_vs_base": True, "goodput_vs_base": False,
            "capacity_vs_base": False}  # fmt: skip


def across_seeds(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The headline keys over the seeds' runs: the worst seed's value, each key's [min, max]
    (per adapter count for the keys by adapters) and each seed's."""
    worst: dict[str, Any] = {}
    spread: dict[str, Any] = {}

    def over(values: list[float | None], lower_better: bool) -> tuple[Any, Any]:
        known = [v for v in values if v is not None]
        if not known:
            return None, None
        return (max(known) if lower_better else min(known)), [min(known), max(known)]

    for key, lower_better in HEADLINE.items():
        first = runs[0][key]
        if isinstance(first, dict):
            pairs = {c: over([r[key].get(c) for r in runs], lower_better) for c in first}
            worst[key] = {c: pair[0] for c, pair in pairs.items()}
            spread[key] = {c: pair[1] for c, pair in pairs.items()}
        else:
            worst[key], spread[key] = over([r[key] for r in runs], lower_better)
    by_seed = {str(r["seed"]): {key: r[key] for key in HEADLINE} for r in runs}
    return worst | {"range": spread, "by_seed": by_seed}


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _row(name: str, r: dict[str, Any]) -> list[Any]:
    if "skipped" in r:
        return [name, r["skipped"], *["-"] * 8]
    return [
        name, r["requests"], r["finished"], _fmt(r["goodput_rps"]), _fmt(r["output_tok_s"], 0),
        _fmt(r["ttft_p50_ms"], 0), _fmt(r["ttft_p99_ms"], 0), _fmt(r["tpot_p50_ms"], 1),
        _fmt(r["tpot_p99_ms"], 1), r.get("distinct_adapters_used", "-"),
    ]  # fmt: skip


def report(result: dict[str, Any]) -> str:
    runs = result["runs"]
    header = ["run", "requests", "finished", "goodput req/s", "output tok/s", "TTFT p50 ms",
              "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "adapters used"]  # fmt: skip
    rows = [_row(name, r) for name, r in runs.items()]
    merged = result["merged"]["by_adapters"]
    merged_rows = [
        [
            count,
            m["gpus_merged"],
            _fmt(m["goodput_per_gpu_merged_rps"], 3),
            _fmt(m["goodput_per_gpu_multi_lora_rps"], 3),
        ]
        for count, m in merged.items()
    ]
    slo = result["slo"]
    ratios = {k: _fmt(v) for k, v in result["goodput_vs_base"].items()}
    tpot = {k: _fmt(v) for k, v in result["tpot_p50_vs_base"].items()}
    step = result["decode_step_ms"]
    knee = result["knee"]
    bound = " (a lower bound: every rung within)" if knee["lora"]["lower_bound"] else ""
    seeds = result["seeds"]
    spread = (
        f"Seeds {seeds}: the keys above are the worst seed's; [min, max] over the seeds: "
        f"{result['range']}"
        if len(seeds) > 1
        else f"Seed {seeds[0]}."
    )
    return "\n".join(
        [
            f"Device: {result['device']} (preset {result['preset']}); arrivals "
            f"{result['window_s']} s at {result['rate_rps']:.2f} req/s ({result['load']} x the "
            f"base's burst capacity {result['capacity_rps']:.2f} req/s), drain "
            f"{result['drain_s']} s. Goodput: requests "
            f"finished with TTFT <= {slo['ttft_s']} s and TPOT <= {slo['tpot_s']} s, per second.",
            "",
            _engine_line(result["engine"]),
            "",
            f"**goodput_vs_base**: {ratios} (goal >= 0.9 at 1,000 adapters)",
            "",
            f"**tpot_p50_vs_base**: {tpot} (goal <= 1.15 at 8 and 64 adapters)",
            "",
            f"**decode_step_vs_base**: {_fmt(result['decode_step_vs_base'], 3)} "
            f"({result['decode']['decode_adapters']} adapters in a step of "
            f"{result['decode']['decode_rows']} rows: {step['lora']:.2f} ms; base "
            f"{step['base']:.2f} ms; goal <= 1.15)",
            "",
            f"**capacity_vs_base**: {_fmt(result['capacity_vs_base'], 3)} (goal >= 0.85; the "
            f"worst seed's): seed {result['seed']}'s knee (the rate where "
            f"{knee['attainment']:.0%} of requests meet both SLOs) with "
            f"{knee['adapters']} adapters {_fmt(knee['lora']['knee_rps'])} req/s{bound}, the "
            f"base's {_fmt(knee['base']['knee_rps'])} req/s; ladder {knee['loads']} x the burst "
            f"capacity, {knee['window_s']} s each.",
            "",
            spread,
            "",
            markdown_table(header, rows),
            "",
            "Merged deployments (one adapter merged into the base's weights per deployment): "
            + result["merged"]["note"]
            + ". Same total load:",
            "",
            markdown_table(
                ["adapters", "GPUs merged", "goodput/GPU merged", "goodput/GPU multi-LoRA (1 GPU)"],
                merged_rows,
            ),
            "",
        ]
    )


def plot(result: dict[str, Any], path: Path) -> None:
    """Goodput ratio per adapter count, and the two decode steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    counts = list(result["goodput_vs_base"])
    values = [result["goodput_vs_base"][c] or 0.0 for c in counts]
    left.bar(counts, values, color="tab:blue")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="base alone")
    left.set_xlabel("adapters (Zipf(1) popularity)")
    left.set_ylabel("goodput / base goodput")
    left.legend(fontsize=8)
    step = result["decode_step_ms"]
    right.bar(["base", f"{result['decode']['decode_adapters']} adapters"],
              [step["base"], step["lora"]], color=["tab:grey", "tab:orange"])  # fmt: skip
    right.set_ylabel(f"decode step of {result['decode']['decode_rows']} rows (ms)")
    figure.suptitle(f"Multi-LoRA serving ({result['device']}, rank {result['engine']['rank']})")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _engine_line(engine: dict[str, Any]) -> str:
    """The LoRA engine's slots and host LRU (runs before the key: fixed slots)."""
    unified = engine.get("unified_slots", False)
    slots = f"{engine['max_loras']} {'resident at most (unified slots)' if unified else 'slots'}"
    return f"LoRA engine: {slots}, {engine['max_cpu_loras']} adapters in host memory."
