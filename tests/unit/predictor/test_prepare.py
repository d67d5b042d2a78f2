from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from fedllm_contract.tokenizer import load_tokenizer
from predictor import prepare as prepare_module
from predictor.prepare import (
    LabeledRecord,
    LengthCounter,
    prepare,
    split_of,
    training_fingerprint,
)


def test_split_is_a_pure_function_of_the_prompt():
    prompts = [f"prompt number {i}" for i in range(3000)]
    first = [split_of(p) for p in prompts]
    assert first == [split_of(p) for p in prompts]
    counts = Counter(first)
    assert 0.77 < counts["train"] / 3000 < 0.83
    assert 0.08 < counts["validation"] / 3000 < 0.12
    assert 0.08 < counts["test"] / 3000 < 0.12


@pytest.mark.parametrize(
    ("prompt", "split"),
    [("", "validation"), ("Write a poem about the sea.", "test"), ("prompt number 7", "train")],
)
def test_split_values_never_change_between_versions(prompt, split):
    # Pinned: a change here would silently move records between training and test sets.
    assert split_of(prompt) == split


def test_fingerprint_depends_on_ids_and_lengths_in_order():
    a = LabeledRecord("x:0", "x", "p", 10)
    b = LabeledRecord("x:1", "x", "q", 20)
    assert training_fingerprint([a, b]) == training_fingerprint([a, b])
    assert training_fingerprint([a, b]) != training_fingerprint([b, a])
    assert training_fingerprint([a, b]) != training_fingerprint(
        [a, LabeledRecord("x:1", "x", "q", 21)]
    )


def _write_corpora(directory: Path) -> None:
    def row(i: int, **extra: object) -> dict[str, object]:
        return {"instruction": f"Task {i}", "input": "", "output": "word " * (i % 7), **extra}

    alpaca = [row(i, sources=["a5000"] if i % 2 else ["claude"]) for i in range(40)]
    (directory / "alpaca.jsonl").write_text("\n".join(json.dumps(r) for r in alpaca))
    (directory / "dolly_3k.json").write_text(json.dumps([row(100 + i) for i in range(20)]))
    (directory / "lima.json").write_text(json.dumps([row(200 + i) for i in range(10)]))
    gsm = [{"question": f"Q {i}?", "answer": "x " * i} for i in range(20)]
    (directory / "gsm8k_train.jsonl").write_text("\n".join(json.dumps(r) for r in gsm))


def test_prepare_splits_and_counts_with_a_cache(tmp_path, gpt2_tokenizer_dir, monkeypatch):
    _write_corpora(tmp_path)
    cache = tmp_path / "cache"
    data = prepare(tmp_path, gpt2_tokenizer_dir, cache, progress=lambda _: None)
    everything = data.train + data.validation + [r for rs in data.test.values() for r in rs]
    tokenizer = load_tokenizer(gpt2_tokenizer_dir)
    for record in everything:
        number = int(record.prompt.split()[-1].rstrip("?"))
        response = "x " * number if record.corpus == "gsm8k" else "word " * (number % 7)
        assert record.length == len(tokenizer(response)["input_ids"])
    # Curated Alpaca rows (not a5000/r9k) only ever train; random rows are split.
    assert {r.corpus for r in data.train} >= {"alpaca", "alpaca_random"}
    assert all(r.corpus != "alpaca" for r in data.validation)
    held_out = {r.prompt for r in data.validation} | {
        r.prompt for rs in data.test.values() for r in rs
    }
    assert not held_out & {r.prompt for r in data.train}
    assert all(split_of(r.prompt) == "test" for r in data.test["dolly"])
    assert len(list(cache.iterdir())) == 4

    def no_counting(self: LengthCounter, responses: object) -> list[int]:
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(prepare_module.LengthCounter, "_count", no_counting)
    again = prepare(tmp_path, gpt2_tokenizer_dir, cache, progress=lambda _: None)
    assert training_fingerprint(again.train) == training_fingerprint(data.train)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        LengthCounter(tmp_path / "nowhere", tmp_path / "cache")
