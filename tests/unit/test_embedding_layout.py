"""What a model directory says about an embedding model (site_engine/embedding/layout.py), and
which task a site serves its model with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from site_engine.__main__ import task_of
from site_engine.embedding.layout import EmbeddingLayoutError, is_embedding_model, read_layout
from site_engine.settings import SiteSettings


def test_all_minilm_l6_v2_is_mean_pooled_normalized_256_tokens_384_dimensions(
    minilm_dir: Path,
) -> None:
    assert is_embedding_model(minilm_dir)
    layout = read_layout(minilm_dir)
    assert (layout.pooling, layout.normalize) == ("mean", True)
    assert (layout.max_seq_length, layout.dimension) == (256, 384)
    assert layout.encoder_dir == minilm_dir


def _copy_configs(minilm_dir: Path, target: Path) -> Path:
    """The MiniLM directory's JSON files (no weights: the layout reads none)."""
    for source in minilm_dir.rglob("*.json"):
        dest = target / source.relative_to(minilm_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
    return target


def test_a_module_the_site_does_not_run_is_refused_by_name(
    minilm_dir: Path, tmp_path: Path
) -> None:
    model = _copy_configs(minilm_dir, tmp_path / "m")
    modules = json.loads((model / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})  # fmt: skip
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(EmbeddingLayoutError, match="Dense not supported"):
        read_layout(model)


def test_a_pooling_of_two_modes_is_refused(minilm_dir: Path, tmp_path: Path) -> None:
    model = _copy_configs(minilm_dir, tmp_path / "m")
    pooling = model / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text()) | {"pooling_mode_cls_token": True}
    pooling.write_text(json.dumps(config))
    with pytest.raises(EmbeddingLayoutError, match=r"\['cls', 'mean'\]"):
        read_layout(model)


def test_without_normalize_and_with_cls_pooling(minilm_dir: Path, tmp_path: Path) -> None:
    model = _copy_configs(minilm_dir, tmp_path / "m")
    modules = json.loads((model / "modules.json").read_text())[:2]
    (model / "modules.json").write_text(json.dumps(modules))
    pooling = model / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text()) | {"pooling_mode_mean_tokens": False,
                                                "pooling_mode_cls_token": True}  # fmt: skip
    pooling.write_text(json.dumps(config))
    layout = read_layout(model)
    assert (layout.pooling, layout.normalize) == ("cls", False)


def test_the_task_comes_from_the_directory_unless_set(
    minilm_dir: Path, tiny_llama_dir: Path
) -> None:
    assert not is_embedding_model(tiny_llama_dir)

    def settings(model_dir: Path, **overrides: str) -> SiteSettings:
        return SiteSettings.load({}, model_dir=model_dir, **overrides)

    assert task_of(settings(minilm_dir)) == "embed"
    assert task_of(settings(tiny_llama_dir)) == "generate"
    assert task_of(settings(minilm_dir, task="generate")) == "generate"


def test_an_unknown_task_is_refused_naming_the_variable(minilm_dir: Path) -> None:
    from site_engine.settings import SettingsError

    with pytest.raises(SettingsError, match="SITE_TASK"):
        SiteSettings.load(environ={"SITE_TASK": "classify"}, model_dir=minilm_dir)
