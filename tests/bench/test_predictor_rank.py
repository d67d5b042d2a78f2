"""The ranking benchmark's bookkeeping: which model it names the default, its paired differences,
and the held-out report's labels (the served model's own, joined to AlpacaEval's prompts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.predictor.linear_rank import fit_pairwise, fit_ridge
from bench.predictor.rank import aggregate, heldout_records, markdown
from predictor.evaluate import kendall_tau
from predictor.heldout import load_heldout
from predictor.served_labels import (
    LabelManifest,
    ServedLabel,
    append_labels,
    prompt_digest,
    write_manifest,
)
from tests.unit.predictor.test_label_served import write_alpaca_eval


def scores(tau: float, rho: float) -> dict[str, dict[str, float]]:
    one = {"kendall_tau": tau, "spearman": rho, "mae_tokens": 250.0, "p90_coverage": 0.97}
    return {"all": {**one, "accuracy": 0.4}, "alpaca": dict(one)}


def test_the_default_is_the_model_that_ranks_better_on_both_measures() -> None:
    by_seed = {
        0: {"ranking": scores(0.52, 0.68), "classifier": scores(0.50, 0.65)},
        1: {"ranking": scores(0.53, 0.69), "classifier": scores(0.50, 0.65)},
    }
    out = aggregate(by_seed, {"tfidf_ridge": {"kendall_tau": 0.48, "spearman": 0.64}})
    assert out["kendall_tau"] == {
        "ranking": pytest.approx(0.525),
        "classifier": pytest.approx(0.50),
        "tfidf_ridge": 0.48,
    }
    assert out["kendall_tau_min_max"]["ranking"] == [0.52, 0.53]
    assert out["spearman_ranking_minus_classifier"]["min_max"] == pytest.approx([0.03, 0.04])
    assert out["default"] == "ranking"
    # Better on one measure only is not enough.
    by_seed[0]["ranking"] = scores(0.52, 0.60)
    by_seed[1]["ranking"] = scores(0.53, 0.60)
    assert aggregate(by_seed, {})["default"] == "classifier"


def test_the_heldout_report_says_it_is_report_only() -> None:
    by_seed = {0: {"ranking": scores(0.3, 0.4), "classifier": scores(0.2, 0.3)}}
    payload = {
        **aggregate(by_seed, {}),
        "split": "heldout:alpaca_eval",
        "prompts": 3,
        "train_prompts": 10,
        "seeds": [0],
        "baselines": {},
        "p50_ms_single_1thread": {"classifier": 1.0, "ranking": 1.1},
        "latency_note": "n",
        "report_only": True,
        "note": "nothing was chosen on it",
    }
    assert markdown(payload).startswith("**Report only** (nothing was chosen on it)")


def test_heldout_labels_are_joined_to_their_prompts(tmp_path: Path) -> None:
    heldout = write_alpaca_eval(tmp_path / "heldout", ["Say hi.", "Write a long story.", "Why?"])
    labels = tmp_path / "labels"
    manifest = LabelManifest("m", 1024, 0.0, 0, True, "float32", ("alpaca_eval",))
    write_manifest(labels, manifest)
    records = load_heldout("alpaca_eval", heldout)
    append_labels(
        labels,
        [
            ServedLabel("alpaca_eval", r.index, prompt_digest(r.prompt), 5, length, "stop")
            for r, length in zip(records[:2], (4, 900), strict=True)
        ],
    )
    joined = heldout_records(labels, heldout)
    assert [(r.prompt, r.length) for r in joined] == [("Say hi.", 4), ("Write a long story.", 900)]
    with pytest.raises(SystemExit, match="label the held-out prompts first"):
        heldout_records(tmp_path / "none", heldout)


def test_the_linear_rankers_learn_the_order_of_lengths() -> None:
    rng = np.random.default_rng(0)
    words = ["essay", "story", "poem", "yes", "no", "name", "spell", "list"]
    long_words = {"essay", "story", "poem"}
    prompts, lengths = [], []
    for _ in range(400):
        chosen = rng.choice(words, 3)
        prompts.append("please " + " ".join(chosen))
        lengths.append(int(sum(300 if w in long_words else 10 for w in chosen) + rng.integers(9)))
    for fit in (fit_ridge, fit_pairwise):
        ranker = fit(prompts[:300], lengths[:300])
        # The noise inside a level is unknowable (a perfect order of the levels scores 0.81),
        # and TF-IDF rows are normalised, so repeated words blur: well above chance is the bar.
        assert kendall_tau(ranker.scores(prompts[300:]), np.array(lengths[300:])) > 0.5
