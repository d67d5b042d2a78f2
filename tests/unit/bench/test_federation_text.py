"""The federation bench's `text` workload (the predictor's share, issue 34): Dolly prompts with
the served model's own answer lengths, the train split apart from the measured test split, the
arms that differ only in what their gateway knows of lengths, and a predictor trained without a
corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.federation.adapt import offline_scores
from bench.federation.cluster import ARMS, Federation
from bench.federation.options import parse_options
from bench.federation.text_tokens import WordTokens
from bench.federation.text_workload import text_prompts, text_requests
from bench.federation.topology import PRESETS
from bench.federation.workload import LABELS_DIR
from fedllm_contract.tokenizer import load_tokenizer
from predictor.baseline import SklearnConfig
from predictor.prepare import LabeledRecord, split_of
from predictor.served_build import served_records
from predictor.served_labels import LabelFileError, read_labels
from predictor.training import TrainingSet, TrainSpec, train_artifact
from tests.conftest import SHARED

DATA = SHARED / "datasets"
GPT2 = SHARED / "tokenizers" / "gpt2"


@pytest.fixture(scope="module")
def words() -> WordTokens:
    tokenizer = load_tokenizer(GPT2)
    return WordTokens.of(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        tokenizer.decode,
        len(tokenizer),
    )


def test_the_splits_are_disjoint_dolly_prompts_with_their_served_lengths(words) -> None:
    train = text_prompts(words, "train", 200, data_dir=DATA)
    test = text_prompts(words, "test", 200, data_dir=DATA)
    assert len(train) > 5 * len(test) > 0
    assert not {p.text for p in train} & {p.text for p in test}
    dolly = {label.answer_tokens for label in read_labels(LABELS_DIR) if label.corpus == "dolly"}
    for prompt in (*train[:50], *test[:50]):
        assert 0 < len(prompt.token_ids) <= 200
        assert tuple(words.encode_text(prompt.text)) == prompt.token_ids  # sent as it counts
        assert prompt.answer_tokens in dolly
    with pytest.raises(ValueError, match="split"):
        text_prompts(words, "validation", 200, data_dir=DATA)


def test_text_requests_are_the_same_for_a_rate_and_scaled_like_the_replay(words) -> None:
    prompts = text_prompts(words, "test", 200, data_dir=DATA)
    first = text_requests(prompts, 8.0, 20.0, 0, answer_scale=0.125, max_answer_tokens=64)
    again = text_requests(prompts, 8.0, 20.0, 0, answer_scale=0.125, max_answer_tokens=64)
    assert first == again
    assert 100 < len(first) < 230  # Poisson, 160 expected
    assert all(0 < r.at_s < 20.0 for r in first)
    assert [r.at_s for r in first] == sorted(r.at_s for r in first)
    by_text = {p.text: p.answer_tokens for p in prompts}
    for request in first:
        assert request.prompt_text is not None
        assert request.source == "dolly_test"
        expected = max(1, min(64, round(by_text[request.prompt_text] * 0.125)))
        assert request.answer_tokens == expected
    # More requests than the split holds cycle through it.
    many = text_requests(prompts[:10], 50.0, 4.0, 0, answer_scale=1.0, max_answer_tokens=2048)
    assert len({r.prompt_text for r in many}) == 10 < len(many)
    with pytest.raises(ValueError, match="rate"):
        text_requests(prompts, 0.0, 20.0, 0, answer_scale=1.0, max_answer_tokens=64)


def test_the_text_arms_differ_only_in_what_the_gateway_knows_of_lengths() -> None:
    names = ("completion_cost_guess", "completion_cost", "completion_cost_adapted")
    arms = [ARMS[name] for name in (*names, "completion_cost_oracle")]
    assert {arm.policy for arm in arms} == {"completion_cost"}
    guess, base, adapted, oracle = arms
    assert (guess.predictor, guess.plan) == (False, "prompt_ratio")
    assert (base.predictor, base.source) == (True, "base")
    assert (adapted.predictor, adapted.source) == (True, "adapted")
    assert (oracle.predictor, oracle.plan) == (False, "max_tokens")


def test_each_arm_gets_its_own_predictor(tmp_path: Path) -> None:
    federation = Federation(PRESETS["cpu"], tmp_path, {}, GPT2, tmp_path / "base")
    setting = federation._predictor_setting
    assert setting(ARMS["completion_cost"]) == {"GATEWAY_PREDICTOR_DIR": str(tmp_path / "base")}
    assert setting(ARMS["completion_cost_guess"]) == {}
    with pytest.raises(ValueError, match="adapted predictor"):
        setting(ARMS["completion_cost_adapted"])
    federation.adapted_predictor_dir = tmp_path / "adapted"
    assert setting(ARMS["completion_cost_adapted"]) == {
        "GATEWAY_PREDICTOR_DIR": str(tmp_path / "adapted")
    }


def _predictor(tmp_path: Path) -> Path:
    folder = tmp_path / "predictor"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    return folder


def test_the_adapted_arm_needs_the_text_workload_and_a_predictor(tmp_path: Path) -> None:
    common = ["--tokenizer-dir", str(GPT2), "--work-dir", str(tmp_path)]
    options = parse_options(
        ["--workload", "text", "--predictor-dir", str(_predictor(tmp_path)), *common]
    )
    assert options.adapts
    assert "completion_cost_adapted" in options.arms
    assert options.prefix is not None
    assert options.prefix.rates["text"]
    with pytest.raises(ValueError, match="needs --workload text"):
        parse_options(["--workload", "trace", "--arms", "least_requests",
                       "completion_cost_adapted", *common])  # fmt: skip
    with pytest.raises(ValueError, match="needs --workload text"):
        parse_options(["--workload", "text", "--no-predictor", *common])
    with pytest.raises(ValueError, match="adapt-samples"):
        parse_options(["--workload", "text", "--predictor-dir", str(tmp_path / "predictor"),
                       "--adapt-samples", "20", *common])  # fmt: skip
    without = parse_options(["--workload", "text", "--no-predictor", "--arms",
                             "least_requests", "completion_cost_guess", *common])  # fmt: skip
    assert not without.adapts


def test_a_corpus_can_be_left_out_of_the_served_predictors_training() -> None:
    every = served_records(LABELS_DIR, DATA)
    without = served_records(LABELS_DIR, DATA, exclude=("dolly",))
    for split in ("train", "validation", "test"):
        assert {r.corpus for r in every[split]} >= {"dolly", "alpaca"}
        assert "dolly" not in {r.corpus for r in without[split]}
        kept = [r for r in every[split] if r.corpus != "dolly"]
        assert [r.id for r in without[split]] == [r.id for r in kept]
        assert all(split_of(r.prompt) == split for r in without[split][:100])
    with pytest.raises(LabelFileError, match="cannot exclude"):
        served_records(LABELS_DIR, DATA, exclude=("sharegpt",))
    with pytest.raises(LabelFileError, match="at least one must stay"):
        served_records(LABELS_DIR, DATA, exclude=("alpaca", "dolly", "lima", "gsm8k"))


def test_offline_scores_rank_and_err_like_the_predictors_own_metrics(tmp_path: Path) -> None:
    records = [
        LabeledRecord(f"t:{i}", "t", f"{task} number {i}.", length)
        for i in range(60)
        for task, length in (("Write a long essay about the sea", 400), ("Say yes to", 3))
    ]
    spec = TrainSpec("sklearn", "mico_n10_l1024", sklearn=SklearnConfig(max_iter=200))
    train_artifact(spec, TrainingSet(records, records[:20]), tmp_path / "a", progress=print)
    prompts = ["Write a long essay about the sea number 99.", "Say yes to number 98.", "hello"]
    lengths = [400, 3, 5]
    scores = offline_scores({"base": tmp_path / "a"}, prompts, lengths)
    assert set(scores) == {"base", "constant_mean"}
    assert scores["base"]["spearman"] > 0.5  # the essay is ranked above the yes
    assert scores["base"]["mae_tokens"] < scores["constant_mean"]["mae_tokens"]
    constant = scores["constant_mean"]
    assert constant["mean_expected"] == pytest.approx(np.mean(lengths))
    assert constant["mae_tokens"] == pytest.approx(
        np.abs(np.mean(lengths) - np.asarray(lengths)).mean(), 0.01
    )
