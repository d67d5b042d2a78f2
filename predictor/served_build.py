"""The served model's predictor: trained on that model's own answer lengths (a label directory
made by predictor.label_served), built once and reused, like the default artifact.

    python -m predictor.served_build [--labels predictor/labels/smollm2-135m-instruct] \
        [--out var/predictor/smollm2-135m-instruct] [--data-dir D] [--force] [--fast] \
        [--no-rank] [--exclude-corpus NAME ...]

By default the served predictor is the MiniLM classifier with a ranking head on its encoder
(predictor.rank_build): the classifier is built in OUT-classifier, the ranking artifact on it in
OUT (it ranked the validation split's answers better: bench/results/predictor/predictor_rank.md).
`--no-rank` builds the classifier alone in OUT.

`--fast` trains the TF-IDF + logistic regression artifact instead of the MiniLM fine-tune
(seconds instead of ~11 minutes on two cores; a little worse on the test split).
`--exclude-corpus` leaves a corpus's prompts out of training and validation: the predictor of a
deployment whose traffic is a kind of prompt it never saw (the federation bench's `text`
workload adapts one from served traffic).

Splits are the usual ones (SHA-256 of the prompt: train 80% / validation 10% / test 10%), so a
prompt never trains the model that is scored on it. An answer that ran to `max_tokens` is kept
at that length: it is what serving it cost, and what routing must plan for (a greedy loop of a
small model is the commonest such answer; see the README's "Served-model labels"). The buckets
follow the served model's own length distribution (quantiles of the training answers).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path

from predictor.artifact import load_manifest
from predictor.cli import command_parser
from predictor.datasets import DatasetError
from predictor.finetune import FinetuneConfig
from predictor.prepare import training_fingerprint
from predictor.rank_build import (
    DEFAULT_RANK,
    RankBuildError,
    build_ranking_artifact,
    features_cache,
    reusable_ranking,
)
from predictor.ranking import RankConfig
from predictor.served_labels import DEFAULT_LABELS, LabelFileError, read_manifest, served_records
from predictor.training import TrainingSet, TrainSpec, reusable_artifact, train_artifact

_REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = _REPO / "var" / "predictor" / "smollm2-135m-instruct"
# The CPU default's model on fewer prompts: the demo trains it on a fresh machine, within its
# few minutes on two cores.
SERVED_SPEC = TrainSpec("minilm", "quantile_n10", replace(FinetuneConfig(), max_train=10_000))
# TF-IDF over the same wordpieces + logistic regression, on the same buckets: trained in under a
# minute on two cores, so a first demo need not wait ~11 minutes for the MiniLM fine-tune. On the
# served labels' test split it ranks a little worse (Spearman 0.606 vs 0.658, MAE 268 vs 258
# tokens: bench/results/predictor/predictor_served.md, its "tfidf" row is this spec).
SERVED_FAST_SPEC = TrainSpec("sklearn", "quantile_n10")
DEFAULT_FAST_OUT = _REPO / "var" / "predictor" / "smollm2-135m-instruct-tfidf"


def classifier_dir(out: Path) -> Path:
    """Where the classifier under the ranking artifact at `out` lives (its base)."""
    return out.with_name(out.name + "-classifier")


def served_artifact_current(
    out: Path,
    labels_dir: Path = DEFAULT_LABELS,
    data_dir: str | Path | None = None,
    spec: TrainSpec = SERVED_SPEC,
    rank: RankConfig | None = DEFAULT_RANK,
) -> bool:
    """Whether `out` holds what build_served_predictor would build from these labels (reused as
    it is): the ranking artifact on a current classifier, or the classifier alone."""
    fingerprint = training_fingerprint(served_records(labels_dir, data_dir)["train"])
    if not _ranks(spec, rank):
        return reusable_artifact(out, spec, fingerprint) is not None
    base = reusable_artifact(classifier_dir(out), spec, fingerprint)
    return base is not None and reusable_ranking(out, base, _rank(rank)) is not None


def _ranks(spec: TrainSpec, rank: RankConfig | None) -> bool:
    return spec.kind == "minilm" and rank is not None


def _rank(rank: RankConfig | None) -> RankConfig:
    if rank is None:
        raise ValueError("no ranking configuration")
    return rank


def build_served_predictor(
    out: Path = DEFAULT_OUT,
    labels_dir: Path = DEFAULT_LABELS,
    data_dir: str | Path | None = None,
    force: bool = False,
    spec: TrainSpec = SERVED_SPEC,
    exclude: Collection[str] = (),
    rank: RankConfig | None = DEFAULT_RANK,
) -> Path:
    """Trains (or reuses) the artifact at `out` from the labels; its manifest names the model.

    A MiniLM `spec` with `rank` (the default) builds the classifier in classifier_dir(out) and
    the ranking artifact on it at `out` (predictor.rank_build); `rank=None` builds the classifier
    alone at `out`. A classifier an earlier build left at `out` becomes the base, not rebuilt."""

    def progress(message: str) -> None:
        print(message, flush=True)

    model = read_manifest(labels_dir).model
    splits = served_records(labels_dir, data_dir, exclude)
    fingerprint = training_fingerprint(splits["train"])
    source = {
        "served_model": model,
        "labels": str(labels_dir),
        "length_unit": f"{model} tokens (its own greedy answers, EOS included)",
        "splits": "sha256(prompt) -> train 80% / validation 10% / test 10%",
        **({"excluded_corpora": sorted(exclude)} if exclude else {}),
    }
    data = TrainingSet(splits["train"], splits["validation"], source)
    target = out
    if _ranks(spec, rank):
        target = classifier_dir(out)
        _adopt_classifier(out, target, spec, fingerprint, progress)
    existing = None if force else reusable_artifact(target, spec, fingerprint)
    if existing is not None:
        progress(f"reusing {existing.version} at {target}: same {model} labels and configuration")
    else:
        count = len(splits["train"])
        progress(f"training the {model} length predictor on {count} labelled prompts")
        train_artifact(spec, data, target, training_info={"served_model": model}, progress=progress)
    if not _ranks(spec, rank):
        return out
    base, config = load_manifest(target), _rank(rank)
    if not force and reusable_ranking(out, base, config) is not None:
        progress(f"reusing the ranking artifact at {out}: same classifier and configuration")
        return out
    cache = features_cache(out.parent, base)
    build_ranking_artifact(target, out, data, config, progress=progress, features_cache=cache)
    return out


def _adopt_classifier(
    out: Path, base: Path, spec: TrainSpec, fingerprint: str, progress: Callable[[str], None]
) -> None:
    """Moves a current classifier found at `out` (built before the ranking default) to `base`."""
    if base.exists() or reusable_artifact(out, spec, fingerprint) is None:
        return
    progress(f"{out} holds a current classifier: it becomes the ranking head's base at {base}")
    out.rename(base)


def main(argv: Sequence[str] | None = None) -> int:
    parser = command_parser("predictor.served_build", __doc__)
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--force", action="store_true", help="retrain even if reusable")
    parser.add_argument(
        "--fast",
        action="store_true",
        help="the TF-IDF artifact (seconds to train) instead of MiniLM; "
        f"default --out {DEFAULT_FAST_OUT}",
    )
    parser.add_argument(
        "--no-rank",
        action="store_true",
        help="the classifier alone at --out, without the ranking head (predictor.rank_build)",
    )
    parser.add_argument(
        "--exclude-corpus",
        action="append",
        default=[],
        metavar="NAME",
        help="leave this corpus out of training and validation (repeatable)",
    )
    args = parser.parse_args(argv)
    spec = SERVED_FAST_SPEC if args.fast else SERVED_SPEC
    out = DEFAULT_FAST_OUT if args.fast and args.out == DEFAULT_OUT else args.out
    if args.exclude_corpus and args.out == DEFAULT_OUT:
        parser.error("--exclude-corpus needs its own --out (the default is the served predictor)")
    try:
        rank = None if args.no_rank else DEFAULT_RANK
        build_served_predictor(
            out, args.labels, args.data_dir, args.force, spec, args.exclude_corpus, rank
        )
    except (LabelFileError, DatasetError, RankBuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
