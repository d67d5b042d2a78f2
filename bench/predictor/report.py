"""The predictor benchmark's Markdown tables and its check against the issue's targets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.common import markdown_table
from predictor.prepare import EVAL_DATASETS

MICO_ALPACA_ACCURACY = 0.8537  # MICO's reported accuracy on Alpaca, the bar to beat
SINGLE_P50_TARGET_MS = 2.0
MODELS = ("finetuned", "sklearn", "mean")
METRICS = ("accuracy", "within_one", "majority_baseline", "mae_tokens", "spearman")


def targets(payload: dict[str, Any], main_scheme: str) -> dict[str, Any]:
    alpaca = payload["alpaca_random"][main_scheme]["finetuned"]["accuracy"]
    beats: dict[str, bool] = {}
    for name in EVAL_DATASETS:
        for scheme, row in payload[name].items():
            mine = row["finetuned"]
            beats[f"{name}/{scheme}"] = all(
                mine["mae_tokens"] < row[other]["mae_tokens"]
                and mine["spearman"] > row[other]["spearman"]
                for other in ("sklearn", "mean")
            )
    p50 = payload["latency_ms"]["p50_single_1thread"]
    return {
        "alpaca_accuracy_above_mico": {
            "value": alpaca,
            "target": MICO_ALPACA_ACCURACY,
            "met": alpaca > MICO_ALPACA_ACCURACY,
        },
        "finetuned_beats_baselines_on_mae_and_spearman": {
            "per_test": beats,
            "met": all(beats.values()),
        },
        "p50_single_1thread_ms": {
            "value": p50,
            "target": SINGLE_P50_TARGET_MS,
            "met": p50 <= SINGLE_P50_TARGET_MS,
        },
    }


def markdown_report(payload: dict[str, Any], schemes: Sequence[str]) -> str:
    rows = [
        [
            name,
            scheme,
            model,
            payload[name][scheme][model]["n"],
            *(payload[name][scheme][model][m] for m in METRICS),
        ]
        for name in EVAL_DATASETS
        for scheme in schemes
        for model in MODELS
    ]
    accuracy = markdown_table(["test set", "scheme", "model", "n", *METRICS], rows)
    latency = payload["latency_ms"]
    sklearn = payload.get("latency_ms_sklearn", {})
    latency_rows = [[key, latency[key], sklearn.get(key, "")] for key in latency]
    latency_table = markdown_table(["latency (ms)", "finetuned", "sklearn"], latency_rows)
    target_rows = [[name, value.get("met")] for name, value in payload["targets"].items()]
    return "\n\n".join(
        [
            "## Accuracy (test splits)",
            accuracy,
            "majority_baseline: always the most common training bucket. mae_tokens and "
            "spearman use the expected length (sum of bucket probability x bucket mean).",
            "## Latency (ONNX Runtime, CPU)",
            latency_table,
            "## Targets",
            markdown_table(["target", "met"], target_rows),
        ]
    )
