"""The predictor artifact: a directory the gateway loads, self-describing and checked on load.

    model.onnx       the model (MiniLM classifier or TF-IDF + logistic regression)
    tokenizer.json   the wordpiece tokenizer both kinds read prompts with (truncation set)
    manifest.json    what the model means: bucket edges and per-bucket lengths, version,
                     training-data fingerprint, metrics, training configuration; for a model
                     with a ranking head, which output is its score and the score's map to
                     tokens (`ranking`, predictor.score_map)

The manifest records the model's and tokenizer's SHA-256, so a truncated or swapped file is caught
at load time with a clear ArtifactError instead of as odd predictions later. Writers build the
directory beside its final place and rename it in, so a reader never sees half an artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast

from predictor.buckets import BucketScheme, BucketSchemeError
from predictor.calibration import Calibration
from predictor.decision import BucketDecision
from predictor.distribution import BucketLengths
from predictor.encoding import TOKENIZER_FILE, PromptEncoder
from predictor.score_map import RankingHead

SCHEMA_VERSION = 1
MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
# A MiniLM artifact's torch weights (float16), read only to warm-start a retrain.
WEIGHTS_FILE = "weights.safetensors"
Kind = Literal["minilm", "sklearn"]
KINDS: tuple[Kind, ...] = ("minilm", "sklearn")


class ArtifactError(RuntimeError):
    """An artifact directory is missing, incomplete or corrupt; the message says which file."""


@dataclass(frozen=True, slots=True)
class Manifest:
    kind: Kind
    version: str
    scheme: BucketScheme
    lengths: BucketLengths
    output_buckets: tuple[int, ...]  # the bucket of each model output column
    max_tokens: int
    training_fingerprint: str
    training: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    model_sha256: str = ""
    tokenizer_sha256: str = ""
    schema_version: int = SCHEMA_VERSION
    # How the named bucket is chosen from the probabilities (plain argmax when absent).
    decision: BucketDecision = field(default_factory=BucketDecision)
    # The served-scale map of the expected and p90 lengths (predictor.calibration); absent: the
    # bucket lengths of the training data are the scale.
    calibration: Calibration | None = None
    # A second graph output trained to rank (predictor.ranking) and its map to tokens: the
    # expected and p90 lengths come from it, the bucket and probabilities from the classifier.
    ranking: RankingHead | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "kind": self.kind,
            "version": self.version,
            "created": self.created,
            "scheme": {
                **self.scheme.to_json(),
                "representative_lengths": list(self.lengths.representatives),
                "p90_lengths": list(self.lengths.p90),
                "train_counts": list(self.lengths.counts),
            },
            "output_buckets": list(self.output_buckets),
            "decision": self.decision.to_json(),
            "input": {
                "tokenizer": TOKENIZER_FILE,
                "tokenizer_sha256": self.tokenizer_sha256,
                "max_tokens": self.max_tokens,
                "truncation": "right",
            },
            "model": {"file": MODEL_FILE, "sha256": self.model_sha256},
            "training_fingerprint": self.training_fingerprint,
            "training": self.training,
            "metrics": self.metrics,
            **({"calibration": self.calibration.to_json()} if self.calibration else {}),
            **({"ranking": self.ranking.to_json()} if self.ranking else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        """Validates a parsed manifest.json; any missing or inconsistent field is an error."""
        try:
            return _parse(data)
        except (KeyError, TypeError, ValueError, BucketSchemeError) as exc:
            raise ArtifactError(f"invalid {MANIFEST_FILE}: {type(exc).__name__}: {exc}") from exc


def _parse(data: Mapping[str, Any]) -> Manifest:
    if data["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"schema_version {data['schema_version']!r}, expected {SCHEMA_VERSION}")
    if data["kind"] not in KINDS:
        raise ValueError(f"kind {data['kind']!r}, expected one of {KINDS}")
    scheme_data = data["scheme"]
    scheme = BucketScheme(str(scheme_data["name"]), tuple(float(e) for e in scheme_data["edges"]))
    lengths = BucketLengths(
        tuple(float(r) for r in scheme_data["representative_lengths"]),
        tuple(int(p) for p in scheme_data["p90_lengths"]),
        tuple(int(c) for c in scheme_data["train_counts"]),
    )
    if len(lengths.representatives) != scheme.n_buckets:
        raise ValueError(f"{len(lengths.representatives)} lengths for {scheme.n_buckets} buckets")
    outputs = tuple(int(b) for b in data["output_buckets"])
    if (
        not outputs
        or len(set(outputs)) != len(outputs)
        or not set(outputs) <= set(range(scheme.n_buckets))
    ):
        raise ValueError(f"output_buckets {outputs} are not distinct buckets of the scheme")
    max_tokens = int(data["input"]["max_tokens"])
    if max_tokens < 2:
        raise ValueError(f"input.max_tokens {max_tokens} is too small")
    decision = (
        BucketDecision.from_json(data["decision"], scheme.n_buckets)
        if "decision" in data
        else BucketDecision()
    )
    return Manifest(
        kind=cast(Kind, data["kind"]),
        version=_text(data, "version"),
        scheme=scheme,
        lengths=lengths,
        output_buckets=outputs,
        max_tokens=max_tokens,
        training_fingerprint=_text(data, "training_fingerprint"),
        training=dict(data.get("training", {})),
        metrics=dict(data.get("metrics", {})),
        created=str(data.get("created", "")),
        model_sha256=_text(data["model"], "sha256"),
        tokenizer_sha256=_text(data["input"], "tokenizer_sha256"),
        decision=decision,
        calibration=Calibration.from_json(data["calibration"]) if "calibration" in data else None,
        ranking=_ranking(data, cast(Kind, data["kind"])),
    )


def _ranking(data: Mapping[str, Any], kind: Kind) -> RankingHead | None:
    if "ranking" not in data:
        return None
    if kind != "minilm":
        raise ValueError(f"a ranking head needs a MiniLM graph, not kind {kind!r}")
    return RankingHead.from_json(data["ranking"])


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {value!r}")
    return value


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def new_version(kind: Kind, scheme_name: str, fingerprint: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{kind}-{scheme_name}-{stamp}-{fingerprint[:8]}"


def load_manifest(directory: str | Path) -> Manifest:
    """The manifest of an artifact, after checking every file it names is there and intact."""
    path = Path(directory)
    if not path.is_dir():
        raise ArtifactError(f"predictor artifact {path} does not exist or is not a directory")
    try:
        data = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ArtifactError(f"{path} has no {MANIFEST_FILE}: not a predictor artifact") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"cannot read {path / MANIFEST_FILE}: {exc}") from exc
    if not isinstance(data, dict):
        raise ArtifactError(f"{path / MANIFEST_FILE} must hold a JSON object")
    manifest = Manifest.from_json(data)
    for name in (MODEL_FILE, TOKENIZER_FILE):
        if not (path / name).is_file():
            raise ArtifactError(f"{path} is missing {name}")
    if file_sha256(path / TOKENIZER_FILE) != manifest.tokenizer_sha256:
        raise ArtifactError(f"{path / TOKENIZER_FILE} does not match its SHA-256: corrupt")
    if file_sha256(path / MODEL_FILE) != manifest.model_sha256:
        raise ArtifactError(f"{path / MODEL_FILE} does not match the manifest's SHA-256: corrupt")
    return manifest


def write_artifact(
    out: Path,
    manifest: Manifest,
    model_file: Path,
    encoder: PromptEncoder,
    extra_files: Mapping[str, Path] | None = None,
) -> Manifest:
    """Builds the artifact in a staging folder beside `out`, stamps the model's hash and the
    creation time into the manifest, checks it loads, then moves it to `out` (replacing it)."""
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        shutil.copyfile(model_file, staging / MODEL_FILE)
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, staging / name)
        encoder.save(staging)
        final = replace(
            manifest,
            model_sha256=file_sha256(staging / MODEL_FILE),
            tokenizer_sha256=file_sha256(staging / TOKENIZER_FILE),
            created=manifest.created or datetime.now(UTC).isoformat(timespec="seconds"),
        )
        (staging / MANIFEST_FILE).write_text(json.dumps(final.to_json(), indent=2) + "\n")
        load_manifest(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
