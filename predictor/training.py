"""Training one predictor version end to end: fit, export to ONNX, validate, write the artifact.

Validation runs the exported ONNX model through the same runtime the gateway uses, so the
metrics in the manifest are those of the file that ships. The MiniLM model is also tried in
int8 (see predictor.quantize); both sets of numbers go into the manifest.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from predictor.artifact import (
    WEIGHTS_FILE,
    ArtifactError,
    Kind,
    Manifest,
    load_manifest,
    new_version,
    write_artifact,
)
from predictor.baseline import SklearnConfig, export_sklearn_onnx, output_buckets, train_sklearn
from predictor.buckets import BucketScheme, scheme_by_name
from predictor.decision import BucketDecision, fit_decision
from predictor.distribution import BucketLengths, bucket_lengths
from predictor.encoding import PromptEncoder, pretrained_dir
from predictor.evaluate import majority_bucket, score_probabilities
from predictor.finetune import FinetuneConfig, subsample
from predictor.prepare import LabeledRecord, training_fingerprint
from predictor.quantize import accept_quantized, quantize_int8
from predictor.runtime import LengthPredictor

Progress = Callable[[str], None]
ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True, slots=True)
class TrainSpec:
    kind: Kind
    scheme_name: str = "mico_n10_l1024"
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    sklearn: SklearnConfig = field(default_factory=SklearnConfig)
    quantize: bool = True
    int8_per_channel: bool = False
    eval_threads: int = 2

    @property
    def max_tokens(self) -> int:
        return self.finetune.max_tokens if self.kind == "minilm" else self.sklearn.max_tokens

    def config_json(self) -> dict[str, Any]:
        config = self.finetune.to_json() if self.kind == "minilm" else self.sklearn.to_json()
        return {
            "kind": self.kind,
            "scheme": self.scheme_name,
            "model": config,
            "quantize": self.quantize and self.kind == "minilm",
            **({"int8_per_channel": True} if self.int8_per_channel else {}),
        }


@dataclass(frozen=True, slots=True)
class TrainingSet:
    train: Sequence[LabeledRecord]
    validation: Sequence[LabeledRecord]
    source: dict[str, Any] = field(default_factory=dict)  # where the data came from


@dataclass(frozen=True, slots=True)
class _Fitted:
    model_file: Path
    outputs: tuple[int, ...]
    used: int  # training records the model saw
    seconds: float
    weights_file: Path | None = None  # torch weights, for warm-starting a later retrain


def _fit_minilm(
    spec: TrainSpec,
    records: Sequence[LabeledRecord],
    scheme: BucketScheme,
    encoder: PromptEncoder,
    work: Path,
    progress: Progress,
    warm_start: Path | None = None,
) -> _Fitted:
    # Torch is imported only here: training an sklearn artifact does not need it.
    from predictor.finetune import finetune, save_weights
    from predictor.minilm import export_onnx

    config = spec.finetune
    chosen = [records[i] for i in subsample(len(records), config.max_train, config.seed)]
    progress(
        f"fine-tuning {config.layers}-layer MiniLM on {len(chosen)} prompts "
        f"x {config.epochs} epoch(s), {config.threads} threads"
        + (f", warm-started from {warm_start.parent.name}" if warm_start else "")
    )
    started = time.monotonic()
    lengths = [r.length for r in chosen]
    labels = scheme.buckets_of(lengths)
    representatives = bucket_lengths(scheme, [r.length for r in records]).representatives
    model, stats = finetune(
        [r.prompt for r in chosen],
        labels,
        scheme.n_buckets,
        encoder,
        config,
        progress,
        lengths=lengths,
        representatives=representatives,
        warm_start=warm_start,
    )
    path = work / "model.fp32.onnx"
    export_onnx(model, path)
    save_weights(model, work / WEIGHTS_FILE)
    return _Fitted(
        path,
        tuple(range(scheme.n_buckets)),
        stats.examples,
        time.monotonic() - started,
        work / WEIGHTS_FILE,
    )


def _fit_sklearn(
    spec: TrainSpec,
    records: Sequence[LabeledRecord],
    scheme: BucketScheme,
    encoder: PromptEncoder,
    work: Path,
    progress: Progress,
    warm_start: Path | None = None,
) -> _Fitted:
    if warm_start is not None:
        raise ValueError("only a MiniLM predictor can be warm-started")
    progress(f"fitting TF-IDF + logistic regression on {len(records)} prompts")
    started = time.monotonic()
    labels = scheme.buckets_of([r.length for r in records])
    pipeline = train_sklearn(encoder.id_strings([r.prompt for r in records]), labels, spec.sklearn)
    path = work / "model.sklearn.onnx"
    export_sklearn_onnx(pipeline, path)
    return _Fitted(path, output_buckets(pipeline), len(records), time.monotonic() - started)


def validation_metrics(
    manifest: Manifest,
    probabilities: np.ndarray,
    validation: Sequence[LabeledRecord],
    majority: int,
) -> dict[str, Any]:
    """Scores of `probabilities` (one row per validation record) on the whole validation set
    ('all') and on each corpus in it."""
    if not validation:
        return {}
    corpora = np.array([r.corpus for r in validation])
    groups = {"all": np.ones(len(validation), dtype=bool)}
    groups |= {c: corpora == c for c in sorted(set(corpora.tolist()))}
    return {
        name: score_probabilities(
            probabilities[mask],
            manifest.lengths,
            manifest.scheme,
            [r for r, m in zip(validation, mask, strict=True) if m],
            majority,
        ).to_json()
        for name, mask in groups.items()
    }


@dataclass(frozen=True, slots=True)
class _Chosen:
    model_file: Path
    metrics: dict[str, Any]
    validation_probabilities: np.ndarray  # of model_file, one row per validation record


def _choose_model(
    spec: TrainSpec,
    manifest: Manifest,
    fitted: _Fitted,
    encoder: PromptEncoder,
    data: TrainingSet,
    majority: int,
    progress: Progress,
) -> _Chosen:
    progress(f"validating the ONNX model on {len(data.validation)} held-out prompts")
    prompts = [r.prompt for r in data.validation]

    def probabilities(model_file: Path) -> np.ndarray:
        predictor = LengthPredictor(manifest, model_file, encoder, spec.eval_threads)
        return predictor.probabilities(prompts)

    fp32_probs = probabilities(fitted.model_file)
    fp32 = validation_metrics(manifest, fp32_probs, data.validation, majority)
    if spec.kind != "minilm" or not spec.quantize or not data.validation:
        return _Chosen(fitted.model_file, {"validation": fp32}, fp32_probs)
    int8_file = fitted.model_file.with_name("model.int8.onnx")
    quantize_int8(fitted.model_file, int8_file, spec.int8_per_channel)
    int8_probs = probabilities(int8_file)
    int8 = validation_metrics(manifest, int8_probs, data.validation, majority)
    used = accept_quantized(fp32["all"]["accuracy"], int8["all"]["accuracy"])
    progress(
        f"int8: validation accuracy {int8['all']['accuracy']:.4f} vs fp32 "
        f"{fp32['all']['accuracy']:.4f} -> {'using int8' if used else 'keeping fp32'}"
    )
    quantization = {"used": used, "fp32": fp32["all"], "int8": int8["all"]}
    if used:
        return _Chosen(int8_file, {"validation": int8, "quantization": quantization}, int8_probs)
    return _Chosen(
        fitted.model_file, {"validation": fp32, "quantization": quantization}, fp32_probs
    )


def _fit_decision(
    scheme: BucketScheme,
    probabilities: np.ndarray,
    validation: Sequence[LabeledRecord],
    majority: int,
) -> tuple[BucketDecision, dict[str, Any]]:
    """The named-bucket rule (predictor.decision) fitted on the validation split, with the
    validation accuracy before and after (the latter is on the rows it was fitted to)."""
    if not validation:
        return BucketDecision(majority), {}
    truth = scheme.buckets_of([r.length for r in validation])
    decision = fit_decision(probabilities, truth, majority)
    return decision, {
        **decision.to_json(),
        "validation_accuracy_argmax": float((probabilities.argmax(axis=1) == truth).mean()),
        "validation_accuracy_decided": float((decision.apply(probabilities) == truth).mean()),
    }


def train_artifact(
    spec: TrainSpec,
    data: TrainingSet,
    out: Path,
    *,
    scheme: BucketScheme | None = None,
    training_info: dict[str, Any] | None = None,
    progress: Progress = print,
    warm_start: Path | None = None,
) -> Manifest:
    """Trains `spec` on `data.train`, validates on `data.validation`, writes the artifact to out.

    `scheme` fixes the bucket edges (a retrain keeps its base's); by default they come from the
    scheme name (quantile schemes from the training lengths). `warm_start` (an artifact's weights
    file, same layers and buckets) starts a MiniLM from those weights."""
    started = time.monotonic()
    lengths = [r.length for r in data.train]
    scheme = scheme or scheme_by_name(spec.scheme_name, lengths)
    table: BucketLengths = bucket_lengths(scheme, lengths)
    fingerprint = training_fingerprint(data.train)
    encoder = PromptEncoder.from_dir(pretrained_dir(), spec.max_tokens)
    fit = _fit_minilm if spec.kind == "minilm" else _fit_sklearn
    with tempfile.TemporaryDirectory(prefix="predictor-train-") as tmp:
        fitted = fit(spec, data.train, scheme, encoder, Path(tmp), progress, warm_start)
        manifest = Manifest(
            spec.kind,
            new_version(spec.kind, scheme.name, fingerprint),
            scheme,
            table,
            fitted.outputs,
            spec.max_tokens,
            fingerprint,
        )
        majority = majority_bucket(scheme, lengths)
        chosen = _choose_model(spec, manifest, fitted, encoder, data, majority, progress)
        model_file, metrics = chosen.model_file, chosen.metrics
        decision, metrics["decision"] = _fit_decision(
            scheme, chosen.validation_probabilities, data.validation, majority
        )
        progress(f"named bucket: argmax, log-bias {decision.log_bias:+.2f} on bucket {majority}")
        info = {
            "config": spec.config_json(),
            # The sklearn baseline reads the encoder's wordpiece ids; only MiniLM runs the encoder.
            "encoder": ENCODER_NAME,
            "records": len(data.train),
            "records_used": fitted.used,
            "records_by_corpus": dict(Counter(r.corpus for r in data.train)),
            "validation_records": len(data.validation),
            "fit_seconds": round(fitted.seconds, 1),
            "total_seconds": round(time.monotonic() - started, 1),
            "data": data.source,
            **({"weights": WEIGHTS_FILE} if fitted.weights_file else {}),
            **({"warm_start": str(warm_start)} if warm_start else {}),
            **(training_info or {}),
        }
        manifest = Manifest(
            manifest.kind,
            manifest.version,
            scheme,
            table,
            fitted.outputs,
            spec.max_tokens,
            fingerprint,
            info,
            metrics,
            decision=decision,
        )
        extra = {WEIGHTS_FILE: fitted.weights_file} if fitted.weights_file else {}
        final = write_artifact(out, manifest, model_file, encoder, extra)
    progress(f"wrote {final.version} to {out} in {info['total_seconds']:.0f}s")
    return final


def reusable_artifact(out: Path, spec: TrainSpec, fingerprint: str) -> Manifest | None:
    """The artifact at `out` if it is valid and was trained from the same data and config."""
    try:
        manifest = load_manifest(out)
    except ArtifactError:
        return None
    same_data = manifest.training_fingerprint == fingerprint
    if same_data and manifest.training.get("config") == spec.config_json():
        return manifest
    return None
