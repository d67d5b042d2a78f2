"""Which GGUF file a --model path names, what the model is called, and files that are not GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from site_engine.gguf_import import GgufImportError, find_gguf, materialize, model_name_of
from site_engine.model_loading import ModelLoadError, load_model
from site_engine.settings import default_model_name


def touch(path: Path, content: bytes = b"GGUF\x03\x00\x00\x00") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(
    ("files", "named", "found"),
    [
        (["m.Q4_1.gguf"], "m.Q4_1.gguf", "m.Q4_1.gguf"),  # the file itself
        (["m.Q4_1.gguf"], ".", "m.Q4_1.gguf"),  # the only GGUF of a directory
        (["m.gguf", "config.json"], ".", None),  # a transformers directory wins
        (["config.json", "model.safetensors"], ".", None),
        (["notes.txt"], "notes.txt", None),
        (["M.GGUF"], ".", "M.GGUF"),
    ],
)
def test_find_gguf(tmp_path: Path, files: list[str], named: str, found: str | None) -> None:
    for name in files:
        touch(tmp_path / name)
    result = find_gguf(tmp_path / named)
    assert result == (None if found is None else tmp_path / found)


def test_two_gguf_files_are_ambiguous(tmp_path: Path) -> None:
    touch(tmp_path / "a.gguf"), touch(tmp_path / "b.gguf")
    with pytest.raises(GgufImportError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        find_gguf(tmp_path)


@pytest.mark.parametrize(
    ("filename", "name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("llama-3.2-1b.F16.gguf", "llama-3.2-1b"),
        ("qwen2.5-0.5b-instruct-q8_0.gguf", "qwen2.5-0.5b-instruct-q8_0"),
        ("model.gguf", "model"),
        ("model.final.gguf", "model.final"),
        ("mistral-7b.IQ2_XS.gguf", "mistral-7b"),
    ],
)
def test_model_name_drops_the_quantization(filename: str, name: str) -> None:
    assert model_name_of(Path(filename)) == name


def test_default_model_name_of_a_directory_holding_a_gguf(tmp_path: Path) -> None:
    touch(tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert default_model_name(tmp_path / "pkg") == "SmolLM2-135M-Instruct"
    assert default_model_name(tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct"
    )
    assert default_model_name(tmp_path / "some-model-dir") == "some-model-dir"


def test_a_file_that_is_not_gguf_is_refused_before_any_conversion(tmp_path: Path) -> None:
    fake = touch(tmp_path / "fake.gguf", b"PK\x03\x04 a zip, not a model")
    with pytest.raises(GgufImportError, match="is not a GGUF file"):
        materialize(fake, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_model(fake)


def test_a_missing_model_path_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere.gguf")
