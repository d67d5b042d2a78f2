from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from predictor.artifact import (
    MANIFEST_FILE,
    MODEL_FILE,
    SCHEMA_VERSION,
    ArtifactError,
    Manifest,
    file_sha256,
    load_manifest,
)
from predictor.encoding import TOKENIZER_FILE
from predictor.runtime import LengthPredictor


def test_manifest_round_trips_through_json(sklearn_artifact):
    manifest = load_manifest(sklearn_artifact)
    again = Manifest.from_json(json.loads(json.dumps(manifest.to_json())))
    assert again == manifest


def test_manifest_records_what_the_gateway_and_retraining_need(sklearn_artifact):
    data = json.loads((sklearn_artifact / MANIFEST_FILE).read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["kind"] == "sklearn"
    assert data["scheme"]["name"] == "mico_n10_l1024"
    assert len(data["scheme"]["edges"]) == 11
    assert len(data["scheme"]["representative_lengths"]) == 10
    assert len(data["training_fingerprint"]) == 64
    assert data["version"].startswith("sklearn-mico_n10_l1024-")
    assert data["created"]
    assert data["training"]["config"]["kind"] == "sklearn"
    assert set(data["metrics"]["validation"]["all"]) >= {"accuracy", "mae_tokens", "spearman"}


@pytest.fixture
def copy(sklearn_artifact, tmp_path) -> Path:
    target = tmp_path / "artifact"
    shutil.copytree(sklearn_artifact, target)
    return target


@pytest.mark.parametrize("missing", [MANIFEST_FILE, MODEL_FILE, TOKENIZER_FILE])
def test_missing_file_is_an_artifact_error(copy, missing):
    (copy / missing).unlink()
    with pytest.raises(ArtifactError, match=r"missing|no manifest"):
        LengthPredictor.load(copy)


def test_missing_directory_is_an_artifact_error(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        load_manifest(tmp_path / "nothing here")


def test_truncated_model_is_caught_by_its_hash(copy):
    model = copy / MODEL_FILE
    model.write_bytes(model.read_bytes()[:1000])
    with pytest.raises(ArtifactError, match="SHA-256"):
        LengthPredictor.load(copy)


def test_unparseable_manifest_is_an_artifact_error(copy):
    (copy / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ArtifactError, match="cannot read"):
        load_manifest(copy)


def _edit(path: Path, change) -> None:
    data = json.loads((path / MANIFEST_FILE).read_text())
    change(data)
    (path / MANIFEST_FILE).write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(schema_version=99), "schema_version"),
        (lambda d: d.update(kind="gpt"), "kind"),
        (lambda d: d.pop("version"), "version"),
        (lambda d: d["scheme"].update(edges=[0, 5, 3]), "strictly increasing"),
        (lambda d: d["scheme"].update(representative_lengths=[1.0]), "one value per bucket"),
        (lambda d: d.update(output_buckets=[0, 0]), "output_buckets"),
        (lambda d: d.update(output_buckets=[0, 42]), "output_buckets"),
        (lambda d: d["input"].update(max_tokens=1), "max_tokens"),
        (lambda d: d["model"].update(sha256=""), "sha256"),
        (lambda d: d.update(training_fingerprint=7), "training_fingerprint"),
    ],
)
def test_inconsistent_manifest_is_an_artifact_error(copy, change, message):
    _edit(copy, change)
    with pytest.raises(ArtifactError, match=message):
        load_manifest(copy)


def test_edited_tokenizer_is_caught_by_its_hash(copy):
    tokenizer = copy / TOKENIZER_FILE
    tokenizer.write_text(tokenizer.read_text().replace("[CLS]", "[XXX]", 1))
    with pytest.raises(ArtifactError, match="SHA-256"):
        LengthPredictor.load(copy)


def test_unloadable_tokenizer_with_a_matching_hash_is_an_artifact_error(copy):
    (copy / TOKENIZER_FILE).write_text("{}")
    _edit(copy, lambda d: d["input"].update(tokenizer_sha256=file_sha256(copy / TOKENIZER_FILE)))
    with pytest.raises(ArtifactError, match="cannot load"):
        LengthPredictor.load(copy)
