"""Command line: build (or reuse) the default predictor artifact that the demo serves.

    python -m predictor.build_default [--out var/predictor/default] [--data-dir D]
        [--tokenizer-dir T] [--cache-dir C] [--force]

An artifact already at --out is reused when it is valid and was trained from the same data
(training fingerprint) with the same configuration; otherwise a new one replaces it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from predictor.cli import command_parser
from predictor.finetune import FinetuneConfig
from predictor.prepare import prepare, training_fingerprint
from predictor.train import add_data_arguments, training_set
from predictor.training import TrainSpec, reusable_artifact, train_artifact

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "var" / "predictor" / "default"
# Chosen on the validation split (bench/results/predictor/predictor.md has the test numbers): see
# README in this folder. Builds in a few minutes on two cores.
DEFAULT_SPEC = TrainSpec("minilm", "mico_n10_l1024", FinetuneConfig())


def build_default(
    out: Path = DEFAULT_OUT,
    data_dir: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
) -> Path:
    def progress(message: str) -> None:
        print(message, flush=True)

    data = prepare(data_dir, tokenizer_dir, cache_dir, progress)
    existing = (
        None if force else reusable_artifact(out, DEFAULT_SPEC, training_fingerprint(data.train))
    )
    if existing is not None:
        progress(f"reusing {existing.version} at {out}: same training data and configuration")
        return out
    train_artifact(DEFAULT_SPEC, training_set(data, data_dir), out, progress=progress)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = command_parser("predictor.build_default", __doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    add_data_arguments(parser)
    parser.add_argument("--force", action="store_true", help="retrain even if reusable")
    args = parser.parse_args(argv)
    try:
        build_default(args.out, args.data_dir, args.tokenizer_dir, args.cache_dir, args.force)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
