"""How far a different decision rule could move accuracy on MICO's scheme.

    python -m bench.predictor.ceiling [--artifact NAME=DIR ...] [--data-dir D]
        [--tokenizer-dir T] [--cache-dir C] [--results-name NAME]

The fine-tuned model's accuracy on Alpaca's random rows sits at the majority rate (always
bucket 0) while its ranking is far better than the baselines'. Argmax is the accuracy-optimal
rule only for calibrated probabilities, so this asks: would any bias toward or away from
bucket 0 beat MICO's 85.37%, even with the bias tuned on the test split itself? That tuned
accuracy is an upper bound on what post-hoc recalibration of the model could reach; next to it,
the accuracy of the artifact's own rule, whose bias was fitted on the validation split. Also
reported: how many prompts the model sends out of bucket 0 and how often it is right there,
and the bucket-0 share of the prompts it ranks longest.

Artifacts default to those `python -m bench.predictor` leaves under var/predictor/bench.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import markdown_table, results_dir, write_results
from bench.predictor.__main__ import DEFAULT_WORK_DIR
from bench.predictor.report import MICO_ALPACA_ACCURACY
from predictor.decision import BIAS_GRID, BucketDecision
from predictor.prepare import prepare
from predictor.runtime import LengthPredictor
from predictor.train import add_data_arguments

TOP_FRACTIONS = (0.01, 0.02, 0.05, 0.10)
TEST_SET = "alpaca_random"


def ceiling(
    probabilities: np.ndarray,
    buckets: np.ndarray,
    expected: np.ndarray,
    fitted: BucketDecision,
) -> dict[str, Any]:
    """Accuracy of argmax, of the artifact's rule (`fitted` on validation), the best over
    BIAS_GRID on these very labels, and where the model's non-zero answers and its
    longest-ranked prompts land."""
    accuracies = np.array(
        [(BucketDecision(0, float(b)).apply(probabilities) == buckets).mean() for b in BIAS_GRID]
    )
    best = int(accuracies.argmax())
    argmax = probabilities.argmax(axis=1)
    away = argmax != 0
    order = np.argsort(-expected, kind="stable")
    return {
        "majority_rate": float((buckets == 0).mean()),
        "argmax_accuracy": float((argmax == buckets).mean()),
        "fitted_log_bias": fitted.log_bias,
        "fitted_accuracy": float((fitted.apply(probabilities) == buckets).mean()),
        "best_bias": float(BIAS_GRID[best]),
        "best_accuracy_tuned_on_test": float(accuracies[best]),
        "predicted_not_bucket0": int(away.sum()),
        "correct_when_not_bucket0": float((argmax[away] == buckets[away]).mean())
        if away.any()
        else None,
        "bucket0_share_of_longest_ranked": {
            f"top_{fraction:.0%}": float(
                (buckets[order[: max(1, round(fraction * len(order)))]] == 0).mean()
            )
            for fraction in TOP_FRACTIONS
        },
    }


def default_artifacts() -> dict[str, Path]:
    found = sorted(DEFAULT_WORK_DIR.glob("*-mico_n10_l1024"))
    return {path.name.removesuffix("-mico_n10_l1024"): path for path in found}


def parse_artifacts(values: Sequence[str]) -> dict[str, Path]:
    artifacts: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--artifact takes NAME=DIR, got {value!r}")
        artifacts[name] = Path(path)
    return artifacts


def report(rows: dict[str, dict[str, Any]]) -> str:
    header = [
        "model",
        "majority",
        "argmax acc.",
        "artifact's rule acc. (bias fitted on validation)",
        "best acc. (bias tuned on test)",
        "bias",
        "argmax: out of bucket 0",
        "right there",
        "bucket-0 share, top 5% longest",
    ]
    table = [
        [
            name,
            row["majority_rate"],
            row["argmax_accuracy"],
            f"{row['fitted_accuracy']:.3f} ({row['fitted_log_bias']:+.2f})",
            row["best_accuracy_tuned_on_test"],
            row["best_bias"],
            row["predicted_not_bucket0"],
            row["correct_when_not_bucket0"] if row["correct_when_not_bucket0"] is not None else "-",
            row["bucket0_share_of_longest_ranked"]["top_5%"],
        ]
        for name, row in rows.items()
    ]
    return (
        f"Test split: {TEST_SET}, scheme mico_n10_l1024; "
        f"MICO reports {MICO_ALPACA_ACCURACY:.2%}.\n\n" + markdown_table(header, table)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.predictor.ceiling", description=__doc__)
    parser.add_argument("--artifact", action="append", default=[], help="NAME=DIR, repeatable")
    parser.add_argument("--results-name", default="predictor_accuracy_ceiling")
    add_data_arguments(parser)
    args = parser.parse_args(argv)
    artifacts = parse_artifacts(args.artifact) or default_artifacts()
    if not artifacts:
        raise SystemExit(f"no artifacts: run python -m bench.predictor first ({DEFAULT_WORK_DIR})")
    data = prepare(args.data_dir, args.tokenizer_dir, args.cache_dir, lambda _: None)
    records = data.test[TEST_SET]
    prompts = [r.prompt for r in records]
    rows: dict[str, dict[str, Any]] = {}
    for name, path in artifacts.items():
        predictor = LengthPredictor.load(path, threads=2)
        buckets = predictor.manifest.scheme.buckets_of([r.length for r in records])
        predictions = predictor.predict_batch(prompts)
        probabilities = np.array([p.probabilities for p in predictions])
        expected = np.array([p.expected_tokens for p in predictions])
        fitted = predictor.manifest.decision
        rows[name] = {
            "version": predictor.version,
            **ceiling(probabilities, buckets, expected, fitted),
        }
    command = "python -m bench.predictor.ceiling " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    markdown = report(rows)
    write_results(
        args.results_name,
        {"test_set": TEST_SET, "models": rows},
        markdown,
        command,
        results_dir("predictor"),
    )
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
