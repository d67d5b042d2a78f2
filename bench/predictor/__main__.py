"""Length predictor benchmark: accuracy per test set and bucket scheme, and ONNX latency.

    python -m bench.predictor [--preset cpu|gpu] [--schemes mico_n10_l1024,quantile_n10]
        [--work-dir DIR] [--force] [--results-name NAME] [MiniLM options of predictor.train]

Trains (or reuses, when data and configuration are unchanged) the fine-tuned MiniLM model
('finetuned': the default artifact's configuration with --preset cpu, the larger CUDA run with
--preset gpu, see predictor.finetune.PRESETS) and the TF-IDF baseline ('sklearn') for
each scheme, scores them and the training mean ('mean') on each test split, measures the
fine-tuned model's latency, and writes bench/results/predictor/predictor.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import results_dir, write_results
from bench.predictor.latency import measure
from bench.predictor.report import markdown_report, targets
from predictor.evaluate import majority_bucket, score_mean, score_probabilities
from predictor.prepare import EVAL_DATASETS, PreparedData, prepare, training_fingerprint
from predictor.runtime import LengthPredictor
from predictor.train import add_data_arguments, add_model_arguments, spec_from_args, training_set
from predictor.training import TrainSpec, reusable_artifact, train_artifact

DEFAULT_WORK_DIR = Path(__file__).resolve().parents[2] / "var" / "predictor" / "bench"
MODEL_KINDS = {"finetuned": "minilm", "sklearn": "sklearn"}


def log(message: str) -> None:
    print(message, flush=True)


def build_models(
    data: PreparedData, schemes: Sequence[str], work: Path, args: argparse.Namespace
) -> dict[tuple[str, str], Path]:
    fingerprint = training_fingerprint(data.train)
    paths: dict[tuple[str, str], Path] = {}
    for scheme in schemes:
        for model, kind in MODEL_KINDS.items():
            if kind == "minilm":
                spec = spec_from_args(kind, scheme, args)
            else:
                spec = TrainSpec("sklearn", scheme)
            out = (
                work / f"{model}-{scheme}"
                if kind == "sklearn"
                else (work / f"{model}-{args.preset}-{scheme}")
            )
            if args.force or reusable_artifact(out, spec, fingerprint) is None:
                log(f"== training {model} for {scheme}")
                train_artifact(spec, training_set(data, args.data_dir), out, progress=log)
            else:
                log(f"== reusing {out}")
            paths[(model, scheme)] = out
    return paths


def score_all(
    data: PreparedData, schemes: Sequence[str], paths: dict[tuple[str, str], Path]
) -> dict[str, Any]:
    results: dict[str, Any] = {name: {} for name in EVAL_DATASETS}
    train_lengths = [r.length for r in data.train]
    for scheme_name in schemes:
        predictors = {m: LengthPredictor.load(paths[(m, scheme_name)], 2) for m in MODEL_KINDS}
        scheme = predictors["finetuned"].manifest.scheme
        majority = majority_bucket(scheme, train_lengths)
        for name in EVAL_DATASETS:
            records = data.test[name]
            prompts = [r.prompt for r in records]
            row: dict[str, Any] = {}
            for model, predictor in predictors.items():
                probabilities = predictor.probabilities(prompts)
                manifest = predictor.manifest
                row[model] = score_probabilities(
                    probabilities, manifest.lengths, scheme, records, majority, manifest.decision
                ).to_json()
                # What plain argmax would have named (the decision's bias was fitted on the
                # validation split, never on these rows).
                argmax = score_probabilities(
                    probabilities, manifest.lengths, scheme, records, majority
                )
                row[model]["accuracy_argmax"] = argmax.accuracy
            row["mean"] = score_mean(scheme, train_lengths, records, majority).to_json()
            results[name][scheme_name] = row
    return results


def model_info(paths: dict[tuple[str, str], Path]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for (model, scheme), path in paths.items():
        manifest = LengthPredictor.load(path).manifest
        info[f"{model}/{scheme}"] = {
            "version": manifest.version,
            "edges": list(manifest.scheme.edges),
            "training": {
                k: manifest.training.get(k)
                for k in ("config", "records", "records_used", "fit_seconds", "total_seconds")
            },
            "quantization": manifest.metrics.get("quantization"),
            "decision": manifest.metrics.get("decision"),
            "validation_all": manifest.metrics.get("validation", {}).get("all"),
        }
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.predictor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--schemes", default="mico_n10_l1024,quantile_n10")
    parser.add_argument(
        "--results-name", default="predictor", help="bench/results/predictor/NAME.json"
    )
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    parser.add_argument("--force", action="store_true", help="retrain even if reusable")
    add_model_arguments(parser)
    add_data_arguments(parser)
    args = parser.parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    started = time.monotonic()
    data = prepare(args.data_dir, args.tokenizer_dir, args.cache_dir, log)
    paths = build_models(data, schemes, args.work_dir, args)
    log("== scoring the test splits")
    payload: dict[str, Any] = score_all(data, schemes, paths)
    log("== measuring latency")
    test_prompts = [r.prompt for r in data.test["alpaca_random"]]
    payload["latency_ms"] = measure(paths[("finetuned", schemes[0])], test_prompts)
    payload["latency_ms_sklearn"] = measure(paths[("sklearn", schemes[0])], test_prompts)
    payload["models"] = model_info(paths)
    payload["test_records"] = {name: len(data.test[name]) for name in EVAL_DATASETS}
    payload["targets"] = targets(payload, schemes[0])
    payload["finetune_preset"] = args.preset
    payload["bench_seconds"] = round(time.monotonic() - started, 1)
    command = "python -m bench.predictor " + " ".join(sys.argv[1:] if argv is None else argv)
    report = markdown_report(payload, schemes)
    path = write_results(
        args.results_name, payload, report, command.strip(), results_dir("predictor")
    )
    print(report)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
