"""Command line: train one predictor artifact from the shared corpora.

    python -m predictor.train --kind minilm|sklearn --scheme mico_n10_l1024 --out DIR
        [--data-dir D] [--tokenizer-dir T] [--cache-dir C] [--preset cpu|gpu]
        [--max-train N] [--epochs E] [--layers L] [--threads K] [--no-quantize]
        [--int8-per-channel] [--[no-]prompt-length-feature]

--preset picks the MiniLM fine-tuning configuration (predictor.finetune.PRESETS): "cpu" (the
default artifact's, minutes on two cores) or "gpu" (a CUDA device; seconds on an H200). The
other model options override the preset's values.

The response lengths are counted in the serving model's tokenizer (--tokenizer-dir, GPT-2 by
default) and cached under --cache-dir (var/predictor/cache by default).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

from predictor.artifact import KINDS, Kind, Manifest
from predictor.baseline import SklearnConfig
from predictor.buckets import SCHEME_NAMES_HELP
from predictor.cli import command_parser
from predictor.finetune import PRESETS
from predictor.prepare import PreparedData, Progress, prepare
from predictor.training import TrainingSet, TrainSpec, train_artifact


def training_set(data: PreparedData, data_dir: str | Path | None) -> TrainingSet:
    source = {
        "data_dir": str(data_dir or "default"),
        "length_tokenizer": data.tokenizer_dir,
        "length_tokenizer_sha256": data.tokenizer_digest,
        "splits": "sha256(prompt) -> train 80% / validation 10% / test 10%",
    }
    return TrainingSet(data.train, data.validation, source)


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, help="corpora (default: ../shared/datasets)")
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        help="serving model's tokenizer, counts lengths (default: GPT-2)",
    )
    parser.add_argument("--cache-dir", type=Path, help="length cache (var/predictor/cache)")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument(
        "--max-train", type=int, help="MiniLM: training prompts to sample (0 = all)"
    )
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--layers", type=int, help="MiniLM: encoder layers kept (1-6)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--no-quantize", action="store_true", help="MiniLM: never use int8")
    parser.add_argument(
        "--int8-per-channel", action="store_true", help="MiniLM: int8 scales per weight column"
    )
    parser.add_argument(
        "--prompt-length-feature",
        action=argparse.BooleanOptionalAction,
        help="MiniLM: the head also reads the whole prompt's length (default: the preset's)",
    )


def spec_from_args(kind: str, scheme: str, args: argparse.Namespace) -> TrainSpec:
    overrides = {
        name: getattr(args, name)
        for name in ("max_train", "epochs", "layers", "threads")
        if getattr(args, name) is not None
    }
    if args.prompt_length_feature is not None:
        overrides["prompt_length_feature"] = args.prompt_length_feature
    finetune = replace(PRESETS[args.preset], **overrides)
    return TrainSpec(
        cast(Kind, kind),
        scheme,
        finetune,
        SklearnConfig(),
        quantize=not args.no_quantize,
        int8_per_channel=args.int8_per_channel,
        eval_threads=finetune.threads,
    )


def build(spec: TrainSpec, out: Path, args: argparse.Namespace, progress: Progress) -> Manifest:
    data = prepare(args.data_dir, args.tokenizer_dir, args.cache_dir, progress)
    progress(f"data: {len(data.train)} training, {len(data.validation)} validation prompts")
    return train_artifact(spec, training_set(data, args.data_dir), out, progress=progress)


def main(argv: Sequence[str] | None = None) -> int:
    parser = command_parser("predictor.train", __doc__)
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--scheme", default="mico_n10_l1024", help=SCHEME_NAMES_HELP)
    parser.add_argument("--out", type=Path, required=True, help="artifact directory to write")
    add_data_arguments(parser)
    add_model_arguments(parser)
    args = parser.parse_args(argv)

    def progress(message: str) -> None:
        print(message, flush=True)

    try:
        manifest = build(spec_from_args(args.kind, args.scheme, args), args.out, args, progress)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = manifest.metrics.get("validation", {}).get("all", {})
    print(f"validation: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
