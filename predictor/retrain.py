"""Adapting a predictor to the served model from the gateway's (prompt, true length) samples.

A pure function over samples and paths: the caller fetches samples from wherever they live and
decides what to do with the report (register, activate). Two modes, each producing a candidate
version that keeps the base's kind and bucket edges (its buckets mean the same to the router):

- `calibrate` (seconds): the base model unchanged, with a new calibration map of its expected
  and p90 lengths onto the served lengths (predictor.calibration). Fixes the scale.
- `retrain` (minutes on 2 cores for a few thousand samples): a MiniLM fine-tuned on the served
  samples, warm-started from the base artifact's weights (so a few hundred samples move a model
  that already ranks prompts, instead of a fresh head learning from scratch), optionally mixed
  with the base corpora, then calibrated like the above. Fixes the ranking too.

Samples are split by a hash of the prompt: the gate split (predictor.gate) is never trained,
calibrated or chosen on; the rest trains (and a hashed share of it validates the model choice).
The gate scores the candidate against the active version, the served mean and TF-IDF on the
gate split, and says whether to activate it.

The samples' lengths are in the serving model's tokens; mixing in the base corpora only makes
sense if those are counted with the same tokenizer (`tokenizer_dir`, GPT-2 by default).
"""

from __future__ import annotations

import hashlib
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from predictor.artifact import WEIGHTS_FILE
from predictor.calibrate import write_calibrated
from predictor.calibration import MIN_SAMPLES, fit_calibration
from predictor.finetune import FinetuneConfig, base_finetune_config, subsample
from predictor.gate import (
    GATE_FRACTION,
    GateDecision,
    Predictions,
    Scores,
    constant_rival,
    decide,
    in_gate_split,
)
from predictor.prepare import LabeledRecord, Progress, prepare
from predictor.runtime import LengthPredictor
from predictor.tfidf_length import fit_tfidf_length
from predictor.training import TrainingSet, TrainSpec, train_artifact

Mode = Literal["retrain", "calibrate"]
MODES: tuple[Mode, ...] = ("retrain", "calibrate")
VALIDATION_FRACTION = 0.15  # of the non-gate samples: the model choice of a retrain
MIN_GATE_SAMPLES = 10
CalibrationSamples = Literal["fit", "validation"]


@dataclass(frozen=True, slots=True)
class RetrainConfig:
    """How a retrain fine-tunes (mode "retrain"); the rest of the configuration (layers, input
    length, prompt-length input) is the base artifact's, so its weights can warm-start it."""

    # Fine-tuning examples aimed for: few samples get more epochs (up to max_epochs), many fewer.
    examples_goal: int = 2400
    min_epochs: int = 2
    max_epochs: int = 8
    learning_rate: float = 1e-4
    head_learning_rate: float = 2e-3
    freeze_embeddings: bool = True
    length_loss_weight: float = 0.0  # the expected-length term (predictor.finetune.length_loss)
    warm_start_keep: float = 0.0  # share of the base's weights kept (FinetuneConfig)
    # The samples the calibration map is fitted on: all non-gate samples ("fit": the model
    # trained on most of them) or the validation share only (held out from the fine-tune).
    calibration_samples: CalibrationSamples = "fit"

    def epochs(self, examples: int) -> int:
        wanted = math.ceil(self.examples_goal / max(examples, 1))
        return max(self.min_epochs, min(self.max_epochs, wanted))

    def finetune(self, base: FinetuneConfig, examples: int, device: str) -> FinetuneConfig:
        return replace(
            base,
            epochs=self.epochs(examples),
            max_train=0,
            learning_rate=self.learning_rate,
            head_learning_rate=self.head_learning_rate,
            freeze_embeddings=self.freeze_embeddings,
            length_loss_weight=self.length_loss_weight,
            warm_start_keep=self.warm_start_keep,
            device=device,
        )


DEFAULT_RETRAIN = RetrainConfig()


@dataclass(frozen=True, slots=True)
class RetrainReport:
    mode: Mode
    new_version: str
    base_version: str
    out: Path
    samples: int
    train_samples: int  # trained and calibrated on (validation included)
    gate_samples: int
    base_records_mixed: int
    decision: GateDecision
    seconds: float

    @property
    def better(self) -> bool:
        return self.decision.activate

    @property
    def reason(self) -> str:
        return self.decision.reason

    @property
    def new(self) -> Scores:
        return self.decision.candidate

    @property
    def current(self) -> Scores | None:
        return self.decision.rivals.get("active")


def _checked(samples: Sequence[tuple[str, int]]) -> list[LabeledRecord]:
    records = []
    for i, sample in enumerate(samples):
        if not isinstance(sample, tuple) or len(sample) != 2:
            raise TypeError(f"sample {i} must be a (prompt, completion_tokens) tuple")
        prompt, length = sample
        if not isinstance(prompt, str):
            raise TypeError(f"sample {i}: prompt must be str, got {type(prompt).__name__}")
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"sample {i}: completion tokens must be an int >= 0, got {length!r}")
        key = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:12]
        records.append(LabeledRecord(f"sample:{i}:{key}", "samples", prompt, length))
    return records


def is_held_out(prompt: str, fraction: float) -> bool:
    digest = hashlib.sha256(b"holdout\0" + prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_samples(
    records: list[LabeledRecord], gate_fraction: float
) -> tuple[list[LabeledRecord], list[LabeledRecord]]:
    """(fit, gate): enough of each for a calibration and a verdict, or a clear error."""
    if not 0 < gate_fraction < 1:
        raise ValueError(f"gate_fraction must be within (0, 1), got {gate_fraction}")
    gate = [r for r in records if in_gate_split(r.prompt, gate_fraction)]
    fit = [r for r in records if not in_gate_split(r.prompt, gate_fraction)]
    if len(gate) < MIN_GATE_SAMPLES or len(fit) < MIN_SAMPLES:
        raise ValueError(
            f"{len(records)} samples leave {len(fit)} to learn from (>= {MIN_SAMPLES} needed) "
            f"and {len(gate)} to judge on (>= {MIN_GATE_SAMPLES}): collect more samples"
        )
    return fit, gate


def _training_records(
    train: list[LabeledRecord], base: list[LabeledRecord], spec: TrainSpec
) -> list[LabeledRecord]:
    # Every sample trains; base records fill the rest of MiniLM's subsample budget.
    if spec.kind != "minilm" or spec.finetune.max_train <= 0:
        return train + base
    room = max(0, spec.finetune.max_train - len(train))
    picked = sorted(subsample(len(base), room, spec.finetune.seed).tolist()) if room else []
    return train + [base[i] for i in picked]


@dataclass(frozen=True, slots=True)
class _Options:
    mix_base_data: bool
    spec: TrainSpec | None
    config: RetrainConfig
    device: str
    warm_start: bool
    data_dir: str | Path | None
    tokenizer_dir: str | Path | None
    cache_dir: str | Path | None
    progress: Progress


def _retrained(
    fit: list[LabeledRecord], base: LengthPredictor, base_dir: Path, work: Path, o: _Options
) -> tuple[Path, int]:
    """A fine-tuned model of the base's kind and edges in `work` (not yet calibrated)."""
    manifest = base.manifest
    spec = o.spec or TrainSpec(manifest.kind, manifest.scheme.name, base_finetune_config(manifest))
    spec = replace(spec, scheme_name=manifest.scheme.name)
    corpora = (
        prepare(o.data_dir, o.tokenizer_dir, o.cache_dir, o.progress).train
        if o.mix_base_data
        else []
    )
    train = [r for r in fit if not is_held_out(r.prompt, VALIDATION_FRACTION)]
    validation = [r for r in fit if is_held_out(r.prompt, VALIDATION_FRACTION)] or train
    records = _training_records(train, corpora, spec)
    if spec.kind == "minilm" and o.spec is None:
        finetune = o.config.finetune(spec.finetune, len(records), o.device)
        spec = replace(spec, finetune=finetune)
    weights = base_dir / WEIGHTS_FILE
    warm = weights if o.warm_start and spec.kind == "minilm" and weights.is_file() else None
    o.progress(
        f"retraining on {len(train)} samples + {len(records) - len(train)} base records"
        + (" (warm start)" if warm else " (from the pretrained encoder)")
    )
    train_artifact(
        spec,
        TrainingSet(records, validation, {"samples": len(fit), "base_artifact": str(base_dir)}),
        work,
        scheme=manifest.scheme,
        training_info={"parent_version": base.version},
        progress=o.progress,
        warm_start=warm,
    )
    return work, len(records) - len(train)


def _gate(
    candidate: LengthPredictor,
    active: LengthPredictor,
    fit: list[LabeledRecord],
    gate: list[LabeledRecord],
) -> GateDecision:
    prompts, actual = [r.prompt for r in gate], [r.length for r in gate]

    def predictions_of(predictor: LengthPredictor) -> Predictions:
        predicted = predictor.predict_batch(prompts)
        return Predictions(
            np.array([p.expected_tokens for p in predicted]),
            np.array([p.p90_tokens for p in predicted]),
        )

    fit_lengths = [r.length for r in fit]
    tfidf = fit_tfidf_length([r.prompt for r in fit], fit_lengths)
    rivals = {
        "active": predictions_of(active),
        "served_mean": Predictions(*constant_rival(fit_lengths, len(gate))),
        "tfidf": Predictions(*tfidf.predict(prompts)),
    }
    return decide(predictions_of(candidate), rivals, actual)


def _calibration_records(
    fit: list[LabeledRecord], mode: Mode, config: RetrainConfig
) -> list[LabeledRecord]:
    if mode == "calibrate" or config.calibration_samples == "fit":
        return fit
    held_out = [r for r in fit if is_held_out(r.prompt, VALIDATION_FRACTION)]
    return held_out if len(held_out) >= MIN_SAMPLES else fit


def retrain(
    samples: list[tuple[str, int]],
    base_artifact: Path,
    out: Path,
    *,
    mode: Mode = "retrain",
    mix_base_data: bool = False,
    gate_fraction: float = GATE_FRACTION,
    spec: TrainSpec | None = None,
    config: RetrainConfig = DEFAULT_RETRAIN,
    device: str = "cpu",
    warm_start: bool = True,
    data_dir: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    progress: Progress = print,
) -> RetrainReport:
    """Builds a candidate from the samples (see the module docstring), writes it to `out`, and
    gates it against the base (the active version), the served mean and TF-IDF.

    `config` says how a retrain fine-tunes, `device` where ("cpu", or "cuda"); `spec` replaces
    both with a whole training specification (epochs and all; tests use tiny ones)."""
    started = time.monotonic()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if Path(out).resolve() == Path(base_artifact).resolve():
        raise ValueError(f"out ({out}) must differ from base_artifact: the base stays servable")
    records = _checked(samples)
    fit, gate = split_samples(records, gate_fraction)
    base = LengthPredictor.load(base_artifact, threads=2)
    options = _Options(
        mix_base_data,
        spec,
        config,
        device,
        warm_start,
        data_dir,
        tokenizer_dir,
        cache_dir,
        progress,
    )
    mixed = 0
    with tempfile.TemporaryDirectory(prefix="predictor-retrain-") as tmp:
        model_dir = Path(base_artifact)
        if mode == "retrain":
            model_dir, mixed = _retrained(fit, base, Path(base_artifact), Path(tmp) / "m", options)
        model = base if mode == "calibrate" else LengthPredictor.load(model_dir, threads=2)
        mapped = _calibration_records(fit, mode, config)
        raw = model.raw_expected([r.prompt for r in mapped])
        calibration = fit_calibration(
            raw, [r.length for r in mapped], f"{len(mapped)} served samples"
        )
        write_calibrated(model_dir, out, calibration, parent_version=base.version)
    candidate = LengthPredictor.load(out, threads=2)
    decision = _gate(candidate, base, fit, gate)
    progress(decision.reason)
    return RetrainReport(
        mode=mode,
        new_version=candidate.version,
        base_version=base.version,
        out=out,
        samples=len(records),
        train_samples=len(fit),
        gate_samples=len(gate),
        base_records_mixed=mixed,
        decision=decision,
        seconds=round(time.monotonic() - started, 1),
    )
