"""Retraining from the gateway's collected (prompt, actual completion tokens) samples.

A pure function over samples and paths: the caller fetches samples from wherever they live and
decides what to do with the report (register, activate). The new version keeps the base's kind
and bucket edges, so its predictions mean the same thing to the router. A fixed share of the
samples (chosen by a hash of the prompt, so the same prompt always lands on the same side) is
held out, and both the new and the current version are scored on it.

The samples' lengths are in the serving model's tokens; mixing in the base corpora only makes
sense if those are counted with the same tokenizer (`tokenizer_dir`, GPT-2 by default).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from predictor.evaluate import Scores, majority_bucket, score_model
from predictor.finetune import subsample
from predictor.prepare import LabeledRecord, Progress, prepare
from predictor.runtime import LengthPredictor
from predictor.training import TrainingSet, TrainSpec, train_artifact

# A new version may trade this much rank correlation for a lower MAE and still count as better.
SPEARMAN_TOLERANCE = 0.02


@dataclass(frozen=True, slots=True)
class RetrainReport:
    new_version: str
    base_version: str
    out: Path
    samples: int
    train_samples: int
    holdout_samples: int
    base_records_mixed: int
    new: Scores  # on the held-out samples
    current: Scores
    better: bool
    reason: str


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


def _split(
    records: list[LabeledRecord], fraction: float
) -> tuple[list[LabeledRecord], list[LabeledRecord]]:
    """(train, holdout); both must be non-empty for a retrain to mean anything."""
    if not 0 < fraction < 1:
        raise ValueError(f"holdout_fraction must be within (0, 1), got {fraction}")
    holdout = [r for r in records if is_held_out(r.prompt, fraction)]
    train = [r for r in records if not is_held_out(r.prompt, fraction)]
    if not holdout or not train:
        raise ValueError(
            f"{len(records)} samples leave {len(train)} to train on and {len(holdout)} to hold "
            "out: collect more samples or change holdout_fraction"
        )
    return train, holdout


def _verdict(new: Scores, current: Scores) -> tuple[bool, str]:
    if new.mae_tokens >= current.mae_tokens:
        return False, f"MAE {new.mae_tokens:.1f} is not below {current.mae_tokens:.1f}"
    if new.spearman < current.spearman - SPEARMAN_TOLERANCE:
        return False, f"Spearman fell from {current.spearman:.3f} to {new.spearman:.3f}"
    return True, f"MAE {current.mae_tokens:.1f} -> {new.mae_tokens:.1f}, " + (
        f"Spearman {current.spearman:.3f} -> {new.spearman:.3f}"
    )


def _training_records(
    train: list[LabeledRecord], base: list[LabeledRecord], spec: TrainSpec
) -> list[LabeledRecord]:
    # Every sample trains; base records fill the rest of MiniLM's subsample budget.
    if spec.kind != "minilm" or spec.finetune.max_train <= 0:
        return train + base
    room = max(0, spec.finetune.max_train - len(train))
    picked = sorted(subsample(len(base), room, spec.finetune.seed).tolist()) if room else []
    return train + [base[i] for i in picked]


def retrain(
    samples: list[tuple[str, int]],
    base_artifact: Path,
    out: Path,
    mix_base_data: bool = True,
    holdout_fraction: float = 0.2,
    *,
    spec: TrainSpec | None = None,
    data_dir: str | Path | None = None,
    tokenizer_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    progress: Progress = print,
) -> RetrainReport:
    """Trains a new version from samples (+ the base corpora), scores new vs current on the
    held-out samples, writes the new artifact to `out` and says whether it is better."""
    if Path(out).resolve() == Path(base_artifact).resolve():
        raise ValueError(f"out ({out}) must differ from base_artifact: the base stays servable")
    records = _checked(samples)
    train, holdout = _split(records, holdout_fraction)
    current = LengthPredictor.load(base_artifact, threads=2)
    base_manifest = current.manifest
    spec = spec or TrainSpec(base_manifest.kind, base_manifest.scheme.name)
    spec = replace(spec, scheme_name=base_manifest.scheme.name)
    base = prepare(data_dir, tokenizer_dir, cache_dir, progress).train if mix_base_data else []
    training = _training_records(train, base, spec)
    progress(f"retraining on {len(train)} samples + {len(training) - len(train)} base records")
    source = {"samples": len(records), "base_artifact": str(base_artifact)}
    manifest = train_artifact(
        spec,
        TrainingSet(training, holdout, source),
        out,
        scheme=base_manifest.scheme,
        training_info={"parent_version": current.version},
        progress=progress,
    )
    new = LengthPredictor.load(out, threads=2)
    majority = majority_bucket(base_manifest.scheme, [r.length for r in training])
    scheme = base_manifest.scheme
    # The verdict reads MAE and rank correlation only: the new version's bucket rule was fitted
    # on this holdout (its validation split), so its accuracy here is a little optimistic.
    new_scores = score_model(
        new.probabilities, manifest.lengths, scheme, holdout, majority, manifest.decision
    )
    current_scores = score_model(
        current.probabilities,
        base_manifest.lengths,
        scheme,
        holdout,
        majority,
        base_manifest.decision,
    )
    better, reason = _verdict(new_scores, current_scores)
    return RetrainReport(
        new_version=manifest.version,
        base_version=current.version,
        out=out,
        samples=len(records),
        train_samples=len(train),
        holdout_samples=len(holdout),
        base_records_mixed=len(training) - len(train),
        new=new_scores,
        current=current_scores,
        better=better,
        reason=reason,
    )
