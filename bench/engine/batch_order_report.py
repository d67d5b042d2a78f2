"""bench.engine.batch_order's report: the Markdown table and the PNG of tokens/s by order and
mix. The GPU machine may lack matplotlib: the PNG is then left out, and
`python -m bench.engine.batch_order --replot bench/results/batch_order/batch_order_h100.json`
writes the Markdown and the PNG again from the JSON, here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.engine.batch_order_workload import HIGH_DENSITY

ORDERS = ("submission", "longest_first", "dfs", "blend_predicted", "blend_true")
OTHERS = ("submission", "longest_first", "dfs")


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"Sizing: {payload.get('sizing', 'preset')}.",
        "",
        "| mix | items | order | run s | tokens/s | output tok/s | prefix hit rate | "
        "prompt tokens computed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, mix in payload["mixes"].items():
        for order, row in mix["orders"].items():
            lines.append(
                f"| {name} | {mix['facts']['items']} | {order} | {row['elapsed_s']} | "
                f"{row['tokens_s']} | {row['output_tok_s']} | {row['prefix_hit_rate']} | "
                f"{row['prompt_tokens_computed']} |"
            )
    lines += ["", "Mixes: " + "; ".join(f"{n}: {m['facts']}" for n, m in payload["mixes"].items())]
    probes = {n: m["probe"] for n, m in payload["mixes"].items() if m.get("probe")}
    if probes:
        lines += ["", f"Rate probes: {probes}"]
    if payload.get("skipped"):
        lines += ["", f"Skipped (deadline): {payload['skipped']}"]
    lines += ["", f"throughput_vs_best_other: {payload['throughput_vs_best_other']}"]
    lines += [f"prefix_sharing_vs_dfs: {payload['prefix_sharing_vs_dfs']}"]
    lines += [f"high-density mixes (goal >= 1.15x): {list(HIGH_DENSITY)}"]
    return "\n".join(lines)


def plot(payload: dict[str, Any], path: Path) -> None:
    """Tokens/s of each order, a group of bars a mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(payload["mixes"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(ORDERS)
    for k, order in enumerate(ORDERS):
        values = [payload["mixes"][m]["orders"].get(order, {}).get("tokens_s", 0) for m in mixes]
        ax.bar([i + k * width for i in range(len(mixes))], values, width, label=order)
    ax.set_xticks([i + width * (len(ORDERS) - 1) / 2 for i in range(len(mixes))], mixes)
    ax.set_ylabel("prompt + answer tokens/s")
    ax.set_title(f"batch orders ({payload.get('preset')}): {payload.get('sizing', '')[:60]}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def replot(path: Path) -> None:
    """The Markdown and the PNG again from a results JSON (the GPU machine may lack
    matplotlib): written next to it."""
    payload = json.loads(path.read_text())
    path.with_suffix(".md").write_text(
        f"# {path.stem}\n\nCommand: `{payload['command']}`\n\nMachine: {payload['machine']}"
        f"\n\n{markdown(payload)}\n"
    )
    plot(payload, path.with_suffix(".png"))
