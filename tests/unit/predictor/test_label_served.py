"""The labelling run: real engine, resumable, one seeded order, refuses to mix two runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from predictor.datasets import DatasetError, load_corpus
from predictor.heldout import load_heldout
from predictor.label_served import main as label_main
from predictor.served_labels import LabelFileError, join_records, read_labels, read_manifest


def run(model: Path, out: Path, data_dir: Path, *extra: str) -> None:
    label_main(
        [
            "--model",
            str(model),
            "--out",
            str(out),
            "--data-dir",
            str(data_dir),
            "--corpora",
            "lima",
            "--max-tokens",
            "6",
            "--max-num-seqs",
            "4",
            *extra,
        ]
    )


def test_labels_resume_and_match_the_corpus(
    tiny_llama_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "labels"
    run(tiny_llama_dir, out, data_dir, "--limit", "3")
    first = read_labels(out)
    assert len(first) == 3
    run(tiny_llama_dir, out, data_dir, "--limit", "4")  # resumes: 4 more, none twice
    labels = read_labels(out)
    assert len(labels) == 7
    assert {label.key for label in first} <= {label.key for label in labels}
    assert len((out / "labels.jsonl").read_text().splitlines()) == 7
    assert all(1 <= label.answer_tokens <= 6 for label in labels)
    assert all(label.finish_reason in ("stop", "length") for label in labels)
    # Each label belongs to its prompt: joined back by (corpus, index) and checked by digest.
    joined = list(join_records(load_corpus("lima", data_dir), labels))
    assert len(joined) == 7
    manifest = read_manifest(out)
    assert (manifest.model, manifest.max_tokens, manifest.temperature) == ("tiny-llama", 6, 0.0)


def test_another_run_configuration_is_refused(
    tiny_llama_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "labels"
    run(tiny_llama_dir, out, data_dir, "--limit", "1")
    with pytest.raises(LabelFileError, match="another labelling run"):
        run(tiny_llama_dir, out, data_dir, "--limit", "1", "--seed", "5")


def test_a_torn_last_line_is_ignored_and_a_corrupt_one_is_not(tmp_path: Path) -> None:
    good = {
        "corpus": "lima",
        "index": 1,
        "prompt_sha256": "x",
        "prompt_tokens": 3,
        "answer_tokens": 5,
        "finish_reason": "stop",
    }
    (tmp_path / "labels.jsonl").write_text(json.dumps(good) + "\n" + '{"corpus": "li')
    assert [label.index for label in read_labels(tmp_path)] == [1]
    (tmp_path / "labels.jsonl").write_text("garbage\n" + json.dumps(good) + "\n")
    with pytest.raises(LabelFileError, match=r"labels\.jsonl:1"):
        read_labels(tmp_path)


def write_alpaca_eval(directory: Path, instructions: list[str]) -> Path:
    """A held-out folder holding an alpaca_eval.tar.xz shaped like the shared one."""
    import io
    import tarfile

    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"instruction": text, "output": "an answer", "generator": "m"} for text in instructions]
    payload = json.dumps(rows).encode()
    with tarfile.open(directory / "alpaca_eval.tar.xz", "w:xz") as tar:
        for name in ("alpaca_eval/b-model.json", "alpaca_eval/a-model.json"):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return directory


def test_heldout_prompts_are_labelled_apart_from_the_corpora(
    tiny_llama_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    heldout = write_alpaca_eval(tmp_path / "heldout", ["Say hi.", "  Count to three.  ", "Why?"])
    out = tmp_path / "labels"
    label_main(
        [
            "--model",
            str(tiny_llama_dir),
            "--out",
            str(out),
            "--heldout",
            "alpaca_eval",
            "--heldout-dir",
            str(heldout),
            "--max-tokens",
            "4",
            "--max-num-seqs",
            "2",
        ]
    )
    labels = read_labels(out)
    assert sorted(label.key for label in labels) == [("alpaca_eval", i) for i in range(3)]
    assert read_manifest(out).corpora == ("alpaca_eval",)
    records = load_heldout("alpaca_eval", heldout)
    assert [r.prompt for r in records] == ["Say hi.", "Count to three.", "Why?"]
    assert len(list(join_records(records, labels))) == 3
    # No training command can read them: the corpora loader does not know the set.
    with pytest.raises(DatasetError, match="unknown corpus"):
        load_corpus("alpaca_eval", data_dir)  # type: ignore[arg-type]


def test_a_missing_heldout_archive_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"alpaca_eval\.tar\.xz"):
        load_heldout("alpaca_eval", tmp_path / "empty")
    with pytest.raises(DatasetError, match="held-out folder not found"):
        load_heldout("alpaca_eval", tmp_path / "absent")
    with pytest.raises(DatasetError, match="unknown held-out set"):
        load_heldout("sharegpt", tmp_path / "empty")
