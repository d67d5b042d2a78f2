"""The labelling run: real engine, resumable, one seeded order, refuses to mix two runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from predictor.datasets import load_corpus
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
