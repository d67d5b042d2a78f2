"""How many answer tokens a running request still has to produce, estimated from its predicted
length and what it has produced so far: the rules compared on the served model's own answers.

A site reports the sum of this estimate over its running requests (`predicted_remaining_tokens`);
the gateway's cost model reads it as the time until the site's batch slots free up (the queue
term of gateway/routing/completion_cost.py) and as the answers its new request would slow down.
A request that has outrun its prediction used to count 1 token: with the TF-IDF predictor's
weak ranking, a site full of such requests looked about to empty.

    python -m bench.remaining_tokens [--predictor var/predictor/smollm2-135m-instruct-tfidf] \
        [--labels predictor/labels/smollm2-135m-instruct] [--data-dir ../shared/datasets]

Every (request, tokens produced so far) pair while the request runs is one state: a site's
report at a random moment finds a request in each of its states with equal chance. Per rule:
the bias of the summed estimate (what the queue term reads) and the mean absolute error per
state, over all states and over those past the prediction (the only states the rules treat
differently). The share is chosen by the smallest bias of the sum past the prediction on the
labels' validation split and reported on the test split (predictor.prepare.split_of), which
nothing chose on.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.common import command_line, markdown_table, results_dir, write_results
from predictor.datasets import load_corpus
from predictor.prepare import split_of
from predictor.runtime import LengthPredictor
from predictor.served_labels import join_records, read_labels, read_manifest
from site_engine.engine.core.remaining import OUTRUN_SHARE, remaining_tokens

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PREDICTOR = REPO / "var" / "predictor" / "smollm2-135m-instruct-tfidf"
DEFAULT_LABELS = REPO / "predictor" / "labels" / "smollm2-135m-instruct"

# rule name -> estimate of the tokens left, from (predicted, produced, max_tokens) arrays.
Rule = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


def _past(share: float) -> Rule:
    """Before the prediction: what it says is left; past it: `share` x what was produced."""

    def rule(predicted: np.ndarray, produced: np.ndarray, max_tokens: int) -> np.ndarray:
        ahead = predicted - produced
        late = np.maximum(np.ceil(share * produced), 1)
        estimate: np.ndarray = np.minimum(np.where(ahead >= 1, ahead, late), max_tokens - produced)
        return estimate

    return rule


def _served(predicted: np.ndarray, produced: np.ndarray, max_tokens: int) -> np.ndarray:
    """What the site engine reports (site_engine/engine/core/remaining.py), element by element."""
    rows = zip(predicted.tolist(), produced.tolist(), strict=True)
    return np.asarray([remaining_tokens(p, g, max_tokens) for p, g in rows], dtype=np.float64)


RULES: dict[str, Rule] = {
    "one token (before)": lambda p, g, m: np.minimum(np.maximum(p - g, 1), m - g),
    "a quarter again": _past(0.25),
    "half again": _past(0.5),
    "as long again": _past(1.0),
    "twice again": _past(2.0),
    "three times again": _past(3.0),
    "four times again": _past(4.0),
}


def states(predicted: Sequence[int], actual: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Every running state: (predicted, produced so far, truly left) per request and step."""
    p, g, left = [], [], []
    for pred, true in zip(predicted, actual, strict=True):
        produced = np.arange(true)
        p.append(np.full(true, pred))
        g.append(produced)
        left.append(true - produced)
    return tuple(np.concatenate(x).astype(np.float64) for x in (p, g, left))


def score(
    rule: Rule, predicted: np.ndarray, produced: np.ndarray, left: np.ndarray, max_tokens: int
) -> dict[str, float]:
    estimate = rule(predicted, produced, max_tokens)
    past = produced >= predicted
    return {
        "sum_bias": round(float(estimate.sum() / left.sum() - 1), 4),
        "mae": round(float(np.abs(estimate - left).mean()), 1),
        "past_sum_bias": round(float(estimate[past].sum() / left[past].sum() - 1), 4),
        "past_mae": round(float(np.abs(estimate[past] - left[past]).mean()), 1),
    }


def split_pairs(
    predictor: LengthPredictor, labels: Path, data_dir: Path | None, split: str
) -> tuple[list[int], list[int], int]:
    """(predicted, served length) per labelled prompt of `split`, and the labels' max_tokens."""
    manifest = read_manifest(labels)
    served = read_labels(labels)
    prompts, actual = [], []
    for corpus in manifest.corpora:
        records = load_corpus(corpus, data_dir)  # type: ignore[arg-type]
        for record, label in join_records(records, served):
            if split_of(record.prompt) == split:
                prompts.append(record.prompt)
                actual.append(min(label.answer_tokens, manifest.max_tokens))
    cap = manifest.max_tokens
    predicted = [
        max(1, min(cap, round(p.expected_tokens))) for p in predictor.predict_batch(prompts)
    ]
    return predicted, actual, cap


def evaluate(
    predictor: LengthPredictor, labels: Path, data_dir: Path | None, split: str
) -> dict[str, object]:
    predicted, actual, cap = split_pairs(predictor, labels, data_dir, split)
    p, g, left = states(predicted, actual)
    rules = {**RULES, f"served ({OUTRUN_SHARE:g} again)": _served}
    return {
        "prompts": len(actual),
        "states": len(left),
        "share_of_states_past_prediction": round(float((g >= p).mean()), 3),
        "rules": {name: score(rule, p, g, left, cap) for name, rule in rules.items()},
    }


def markdown(results: dict[str, dict[str, object]]) -> str:
    parts = []
    for split, result in results.items():
        rows = [
            [name, s["sum_bias"], s["mae"], s["past_sum_bias"], s["past_mae"]]
            for name, s in result["rules"].items()  # type: ignore[attr-defined]
        ]
        parts.append(
            f"## {split} split: {result['prompts']} prompts, {result['states']} running states, "
            f"{result['share_of_states_past_prediction']} of them past the prediction\n\n"
            + markdown_table(
                [
                    "rule",
                    "bias of the sum",
                    "MAE per state",
                    "bias of the sum, past the prediction",
                    "MAE past it",
                ],
                rows,
            )
        )
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.remaining_tokens")
    parser.add_argument("--predictor", type=Path, default=DEFAULT_PREDICTOR)
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--name", default="remaining_tokens")
    args = parser.parse_args(argv)
    predictor = LengthPredictor.load(args.predictor)
    results = {
        split: evaluate(predictor, args.labels, args.data_dir, split)
        for split in ("validation", "test")
    }
    payload = {"predictor": str(args.predictor), "labels": str(args.labels), "splits": results}
    path = write_results(
        args.name,
        payload,
        markdown(results),
        command_line("bench.remaining_tokens", argv),
        results_dir("predictor"),
    )
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
