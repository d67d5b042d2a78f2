"""The served model's predictor against the simple baselines, on the served model's own lengths.

    python -m bench.predictor.served [--labels predictor/labels/smollm2-135m-instruct]

On the test split of the labels (prompts no method trained or chose on), in the served model's
tokens: the served-model predictor (predictor.served_build), TF-IDF + logistic regression trained
on the same labels and buckets, the prompt's length alone (an isotonic fit of answer tokens on
prompt characters, p90 per prompt-length decile), the training mean (p90: the training p90), and
the old predictor trained on the corpora's reference answers (GPT-2 tokens of text-davinci-003
and others: `predictor.build_default`), all in one run. Writes
bench/results/predictor/predictor_served.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.isotonic import IsotonicRegression

from bench.common import markdown_table, results_dir, write_results
from predictor.build_default import DEFAULT_OUT as REFERENCE_DIR
from predictor.build_default import build_default
from predictor.evaluate import majority_bucket, spearman
from predictor.prepare import LabeledRecord
from predictor.runtime import LengthPredictor
from predictor.served_build import DEFAULT_OUT, build_served_predictor
from predictor.served_labels import DEFAULT_LABELS, served_records
from predictor.training import TrainingSet, TrainSpec, train_artifact


@dataclass(frozen=True, slots=True)
class Estimates:
    expected: np.ndarray
    p90: np.ndarray
    buckets: np.ndarray | None = None  # in the served predictor's scheme, where it has one


def from_artifact(path: Path, prompts: Sequence[str]) -> Estimates:
    predictor = LengthPredictor.load(path, threads=2)
    predictions = predictor.predict_batch(list(prompts))
    return Estimates(
        np.array([p.expected_tokens for p in predictions]),
        np.array([p.p90_tokens for p in predictions], dtype=np.float64),
        np.array([p.bucket for p in predictions]),
    )


def prompt_length_fit(train: Sequence[LabeledRecord], test: Sequence[LabeledRecord]) -> Estimates:
    x = np.array([len(r.prompt) for r in train], dtype=np.float64)
    y = np.array([r.length for r in train], dtype=np.float64)
    fit = IsotonicRegression(out_of_bounds="clip").fit(x, y)
    edges = np.quantile(x, np.linspace(0, 1, 11)[1:-1])
    p90_by_decile = [float(np.percentile(y[np.digitize(x, edges) == d], 90)) for d in range(10)]
    x_test = np.array([len(r.prompt) for r in test], dtype=np.float64)
    p90 = np.array([p90_by_decile[d] for d in np.digitize(x_test, edges)])
    return Estimates(fit.predict(x_test), p90)


def constant(train: Sequence[LabeledRecord], n: int) -> Estimates:
    lengths = np.array([r.length for r in train], dtype=np.float64)
    return Estimates(np.full(n, lengths.mean()), np.full(n, np.percentile(lengths, 90)))


def scores(est: Estimates, actual: np.ndarray, true_buckets: np.ndarray) -> dict[str, Any]:
    result: dict[str, Any] = {
        "spearman": spearman(est.expected, actual),
        "mae_tokens": float(np.abs(est.expected - actual).mean()),
        "p90_coverage": float((actual <= est.p90).mean()),
        "mean_predicted": float(est.expected.mean()),
    }
    if est.buckets is not None:
        result["bucket_accuracy"] = float((est.buckets == true_buckets).mean())
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    served_dir = build_served_predictor(args.served, args.labels, args.data_dir)
    reference_dir = build_default(args.reference, data_dir=args.data_dir)
    splits = served_records(args.labels, args.data_dir)
    train, test = splits["train"], splits["test"]
    served = LengthPredictor.load(served_dir).manifest
    scheme = served.scheme
    actual = np.array([r.length for r in test], dtype=np.float64)
    true_buckets = scheme.buckets_of([r.length for r in test])
    prompts = [r.prompt for r in test]
    with tempfile.TemporaryDirectory(prefix="tfidf-") as tmp:
        spec = TrainSpec("sklearn", scheme.name)
        train_artifact(spec, TrainingSet(train, splits["validation"]), Path(tmp), scheme=scheme)
        tfidf = from_artifact(Path(tmp), prompts)
    methods = {
        "served_predictor": from_artifact(served_dir, prompts),
        "tfidf": tfidf,
        "prompt_length": prompt_length_fit(train, test),
        "mean": constant(train, len(test)),
        "reference_predictor": from_artifact(reference_dir, prompts),
    }
    results = {name: scores(est, actual, true_buckets) for name, est in methods.items()}
    majority = majority_bucket(scheme, [r.length for r in train])
    by_corpus = {
        corpus: scores(
            Estimates(
                *(
                    a[mask]
                    for a in (methods["served_predictor"].expected, methods["served_predictor"].p90)
                )
            ),
            actual[mask],
            true_buckets[mask],
        )
        for corpus in sorted({r.corpus for r in test})
        if (mask := np.array([r.corpus == corpus for r in test])).any()
    }
    return {
        **results,
        "majority_rate": float((true_buckets == majority).mean()),
        "test_prompts": len(test),
        "train_prompts": len(train),
        "scheme": scheme.to_json(),
        "served_version": served.version,
        "served_predictor_by_corpus": by_corpus,
        "labels": str(args.labels),
    }


def markdown(payload: dict[str, Any]) -> str:
    names = ["served_predictor", "tfidf", "prompt_length", "mean", "reference_predictor"]
    rows = [
        [
            name,
            payload[name]["spearman"],
            payload[name]["mae_tokens"],
            payload[name]["p90_coverage"],
            payload[name]["mean_predicted"],
            payload[name].get("bucket_accuracy", "-"),
        ]
        for name in names
    ]
    table = markdown_table(
        ["method", "Spearman", "MAE tokens", "p90 coverage", "mean predicted", "bucket accuracy"],
        rows,
    )
    corpus_rows = [
        [c, s["spearman"], s["mae_tokens"], s["p90_coverage"]]
        for c, s in payload["served_predictor_by_corpus"].items()
    ]
    return (
        f"Test split of the served-model labels: {payload['test_prompts']} prompts "
        f"(trained on {payload['train_prompts']}); lengths in the served model's tokens; bucket "
        f"majority rate {payload['majority_rate']:.3f} ({payload['scheme']['name']}).\n\n"
        f"{table}\n\n"
        "Served predictor per corpus:\n\n"
        + markdown_table(["corpus", "Spearman", "MAE tokens", "p90 coverage"], corpus_rows)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.predictor.served",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--served", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--reference", type=Path, default=REFERENCE_DIR)
    parser.add_argument("--data-dir", type=Path)
    args = parser.parse_args(argv)
    payload = run(args)
    text = markdown(payload)
    command = "python -m bench.predictor.served " + " ".join(sys.argv[1:] if argv is None else argv)
    write_results("predictor_served", payload, text, command.strip(), results_dir("predictor"))
    print(text)


if __name__ == "__main__":
    main()
