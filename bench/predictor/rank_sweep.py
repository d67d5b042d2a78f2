"""How the ranking head is trained, chosen on training-split prompts only (never validation).

    python -m bench.predictor.rank_sweep [--features FILE.npz] [--seeds 0 1 2]

Reads the encoder features a ranking build cached (predictor.rank_build: the served
classifier's features of the training-split prompts it never saw, in
var/predictor/rank-features/; `python -m predictor.served_build` makes them). A fixed fifth of
those prompts is set aside for this choice; each variant of the head trains on the rest (with
its own early-stopping share inside) and is scored on the fifth by Kendall's tau and Spearman of
its score and by the MAE of the expected length its score map gives (fitted on the prompts it
trained on, as a build fits it), beside the classifier's own expected length (mapped the same
way). Seconds a variant. Writes bench/results/predictor/predictor_rank_sweep.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import command_line, markdown_table, results_dir, write_results
from predictor.artifact import load_manifest
from predictor.evaluate import kendall_tau, spearman
from predictor.finetune import subsample
from predictor.rank_build import DEFAULT_RANK, features_cache, unseen_records
from predictor.ranking import RankConfig, train_rank_head
from predictor.score_map import fit_score_map
from predictor.served_build import DEFAULT_OUT, classifier_dir
from predictor.served_labels import DEFAULT_LABELS, served_records

EVAL_FRACTION = 0.2
_BASE = replace(DEFAULT_RANK, loss="listmle", length_weight=0.0)
_PAIR = replace(_BASE, loss="pairwise", length_weight=1.0)
VARIANTS: dict[str, RankConfig] = {
    # vLLM-LTR's loss as it is: the list's Plackett-Luce likelihood alone.
    "listmle": _BASE,
    "pairwise": replace(_BASE, loss="pairwise"),
    # With the pointwise |score - log length| term beside the ranking loss.
    "listmle_len1": replace(_BASE, length_weight=1.0),
    "listmle_len3": replace(_BASE, length_weight=3.0),
    "pairwise_len0.3": replace(_PAIR, length_weight=0.3),
    "pairwise_len1": _PAIR,
    "pairwise_len3": replace(_PAIR, length_weight=3.0),
    "pairwise_len1_margin0.3": replace(_PAIR, margin=0.3),
    "pairwise_len1_margin1": replace(_PAIR, margin=1.0),
    "pairwise_len1_list64": replace(_PAIR, list_size=64),
    "pairwise_len1_hidden32": replace(_PAIR, hidden=32),
    "pairwise_len1_hidden384": replace(_PAIR, hidden=384),
    "pairwise_len1_lr3e-4": replace(_PAIR, learning_rate=3e-4),
    # The ablation: the length term alone (no ranking loss).
    "pointwise_len1": replace(_BASE, loss="pointwise", length_weight=1.0),
}


def _quiet(_: str) -> None:
    return None


def _mae(
    fit_values: np.ndarray, fit_lengths: np.ndarray, values: np.ndarray, truth: np.ndarray
) -> float:
    expected, _ = fit_score_map(fit_values, fit_lengths).apply(values)
    return float(np.abs(expected - truth).mean())


def sweep(
    features: np.ndarray, log_expected: np.ndarray, lengths: np.ndarray, seeds: list[int]
) -> dict[str, Any]:
    order = np.random.default_rng(12345).permutation(len(lengths))
    cut = int(len(lengths) * EVAL_FRACTION)
    held, fit = order[:cut], order[cut:]
    truth = lengths[held]
    results: dict[str, Any] = {
        "classifier": {
            "kendall_tau": kendall_tau(log_expected[held], truth),
            "spearman": spearman(log_expected[held], truth),
            "mae_tokens": _mae(log_expected[fit], lengths[fit], log_expected[held], truth),
        }
    }
    x_fit, e_fit = torch.from_numpy(features[fit]), torch.from_numpy(log_expected[fit])
    x_held, e_held = torch.from_numpy(features[held]), torch.from_numpy(log_expected[held])
    for name, base in VARIANTS.items():
        rows: dict[str, list[float]] = {"kendall_tau": [], "spearman": [], "mae_tokens": []}
        epochs = []
        for seed in seeds:
            config = replace(base, seed=seed)
            head, stats = train_rank_head(
                features[fit], log_expected[fit], lengths[fit], config, _quiet
            )
            with torch.no_grad():
                on_fit, scores = head(x_fit, e_fit).numpy(), head(x_held, e_held).numpy()
            rows["kendall_tau"].append(kendall_tau(scores, truth))
            rows["spearman"].append(spearman(scores, truth))
            rows["mae_tokens"].append(_mae(on_fit, lengths[fit], scores, truth))
            epochs.append(stats.best_epoch)
        results[name] = {
            **{k: float(np.mean(v)) for k, v in rows.items()},
            **{f"{k}_min_max": [min(v), max(v)] for k, v in rows.items()},
            "best_epochs": epochs,
            "config": base.to_json(),
        }
        print(f"{name}: tau {results[name]['kendall_tau']:.4f}", flush=True)
    return {"variants": results, "eval_prompts": int(cut), "fit_prompts": len(fit), "seeds": seeds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.predictor.rank_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base", type=Path, default=classifier_dir(DEFAULT_OUT))
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--features", type=Path, help="the cached .npz (default: the bench's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--results-dir", type=Path, default=results_dir("predictor"))
    args = parser.parse_args(argv)
    base = load_manifest(args.base)
    path = args.features or features_cache(DEFAULT_OUT.parent, base)
    if not path.is_file():
        sys.exit(
            f"{path} does not exist: run python -m bench.predictor.rank --seeds 0 --build-only"
        )
    unseen = unseen_records(base, served_records(args.labels, args.data_dir)["train"])
    picked = subsample(len(unseen), DEFAULT_RANK.max_train, DEFAULT_RANK.sample_seed)
    lengths = np.array([unseen[i].length for i in picked], dtype=np.int64)
    with np.load(path) as stored:
        features, log_expected = stored["features"], stored["log_expected"]
    if len(features) != len(lengths):
        sys.exit(f"{path} holds {len(features)} rows, the head's prompts are {len(lengths)}")
    payload = {**sweep(features, log_expected, lengths, args.seeds), "base": base.version}

    def span(values: list[float] | None) -> str:
        return f"{values[0]:.3f}-{values[1]:.3f}" if values else "-"

    rows = [
        [
            name,
            r["kendall_tau"],
            span(r.get("kendall_tau_min_max")),
            r["spearman"],
            span(r.get("spearman_min_max")),
            r["mae_tokens"],
        ]
        for name, r in payload["variants"].items()
    ]
    text = (
        f"Training-split prompts the classifier never saw: the head trains on "
        f"{payload['fit_prompts']}, is scored on {payload['eval_prompts']} set aside "
        f"(seeds {args.seeds}; mean, min-max).\n\n"
        + markdown_table(
            ["variant", "Kendall tau", "min-max", "Spearman", "min-max", "MAE tokens"], rows
        )
    )
    write_results(
        "predictor_rank_sweep",
        payload,
        text,
        command_line("bench.predictor.rank_sweep", argv),
        args.results_dir,
    )
    print(text)


if __name__ == "__main__":
    main()
