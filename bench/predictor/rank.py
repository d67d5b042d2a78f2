"""The ranking predictor against the served classifier, on the served model's own answer lengths.

    python -m bench.predictor.rank [--seeds 0 1 2] [--build-only] [--smoke]
    python -m bench.predictor.rank --heldout [--heldout-labels DIR]   # report only, once

The classifier is the served model's classifier as `python -m predictor.served_build` builds it
(var/predictor/smollm2-135m-instruct-classifier; built first when absent). For each seed, a
ranking head on its encoder (predictor.rank_build; the seed drives the head's initialisation, its
lists, their ties and its early-stopping share; the prompts it learns from and their encoder
features are the same for every seed, computed once and cached). Seed 0 is the served predictor
itself (var/predictor/smollm2-135m-instruct), the others are in var/predictor/rank-bench/. Both
are scored through the runtime the gateway uses (ONNX, the artifacts as they ship) on the
labels' validation split: Kendall's tau and Spearman of the expected length against the true
length, MAE, p90 coverage. Beside them, in the same run: TF-IDF + logistic regression on the
same buckets (the fast served artifact), linear rankers over TF-IDF
(bench.predictor.linear_rank) and the prompt's length alone. Writes
bench/results/predictor/predictor_rank.{json,md}; the model that ranks better on both measures
(mean over seeds) is named the default.

The classifier's own seeds are not varied: its fine-tune takes ~11 minutes on two idle cores and
two hours on the shared ones under load, so its spread is not in these figures (the head's is).

`--heldout` scores the same, already built artifacts (it never builds or chooses anything) on
AlpacaEval's prompts labelled with the served model's own answers (predictor.label_served
--heldout alpaca_eval, made on a GPU), and writes predictor_rank_heldout.{json,md}: a report-only
figure, once the settings are fixed on validation.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.predictor.latency import single_prompt_ms
from bench.predictor.linear_rank import fit_pairwise, fit_ridge
from predictor.artifact import ArtifactError, Manifest, load_manifest
from predictor.datasets import DatasetError
from predictor.evaluate import kendall_tau, spearman
from predictor.finetune import FinetuneConfig
from predictor.heldout import ALPACA_EVAL, load_heldout
from predictor.prepare import LabeledRecord, training_fingerprint
from predictor.rank_build import (
    DEFAULT_RANK,
    build_ranking_artifact,
    features_cache,
    reusable_ranking,
    validation_scores,
)
from predictor.ranking import RankConfig
from predictor.runtime import LengthPredictor
from predictor.served_build import (
    DEFAULT_FAST_OUT,
    DEFAULT_OUT,
    SERVED_FAST_SPEC,
    SERVED_SPEC,
    build_served_predictor,
    classifier_dir,
)
from predictor.served_labels import (
    DEFAULT_LABELS,
    join_records,
    read_labels,
    read_manifest,
    served_records,
)
from predictor.training import TrainingSet, reusable_artifact, train_artifact

_REPO = Path(__file__).resolve().parents[2]
WORK_DIR = _REPO / "var" / "predictor" / "rank-bench"
HELDOUT_LABELS = (
    _REPO / "var" / "predictor" / "heldout-labels" / "smollm2-135m-instruct-alpaca_eval"
)
MODELS = ("ranking", "classifier")
# A handful of steps on a few hundred prompts: the pipeline end to end in a minute or two.
SMOKE_FINETUNE = FinetuneConfig(max_train=150, layers=1, max_tokens=32, batch_size=16)
SMOKE_RANK = replace(DEFAULT_RANK, max_train=0, epochs=3, list_size=16, lists_per_step=2)


@dataclass(frozen=True, slots=True)
class Setup:
    labels: Path
    data_dir: Path | None
    work: Path
    smoke: bool
    limit: int  # records of each split (0: all), for the smoke run

    @property
    def classifier_dir(self) -> Path:
        return self.work / "classifier" if self.smoke else classifier_dir(DEFAULT_OUT)

    def ranking_dir(self, seed: int) -> Path:
        """Seed 0 of the default configuration is the served predictor itself."""
        if seed == 0 and not self.smoke:
            return DEFAULT_OUT
        return self.work / f"seed{seed}" / "ranking"

    def features_cache(self, base: Manifest) -> Path:
        return features_cache(self.work if self.smoke else DEFAULT_OUT.parent, base)

    def rank_config(self, seed: int) -> RankConfig:
        return replace(SMOKE_RANK if self.smoke else DEFAULT_RANK, seed=seed)

    def splits(self) -> dict[str, list[LabeledRecord]]:
        splits = served_records(self.labels, self.data_dir)
        if self.limit:
            splits = {name: records[: self.limit] for name, records in splits.items()}
        return splits


def _say(message: str) -> None:
    print(message, flush=True)


def build_classifier(setup: Setup, data: TrainingSet) -> Path:
    """The served classifier (predictor.served_build's, reused when built from these labels; the
    build also makes the served ranking artifact, which is seed 0 here)."""
    if not setup.smoke:
        build_served_predictor(DEFAULT_OUT, setup.labels, setup.data_dir)
        return setup.classifier_dir
    spec = replace(SERVED_SPEC, finetune=SMOKE_FINETUNE)
    if reusable_artifact(setup.classifier_dir, spec, training_fingerprint(data.train)) is None:
        train_artifact(spec, data, setup.classifier_dir, progress=_say)
    return setup.classifier_dir


def build_ranking(setup: Setup, seed: int, classifier: Path, data: TrainingSet) -> Path:
    """The seed's ranking artifact on `classifier`, built unless already there."""
    ranking = setup.ranking_dir(seed)
    base = load_manifest(classifier)
    config = setup.rank_config(seed)
    if reusable_ranking(ranking, base, config) is None:
        _say(f"seed {seed}: training the ranking head on {classifier}")
        cache = setup.features_cache(base)
        build_ranking_artifact(
            classifier, ranking, data, config, progress=_say, features_cache=cache
        )
    return ranking


def built(setup: Setup, seeds: Sequence[int]) -> dict[int, tuple[Path, Path]]:
    """The artifacts an earlier validation run built (the held-out report never builds: its
    settings must already be fixed); ArtifactError when one is missing."""
    base = load_manifest(setup.classifier_dir)
    out = {}
    for seed in seeds:
        ranking = setup.ranking_dir(seed)
        made = load_manifest(ranking).training.get("ranking", {})
        if made.get("base_version") != base.version:
            raise ArtifactError(f"{ranking} was not built on {setup.classifier_dir}")
        out[seed] = (setup.classifier_dir, ranking)
    return out


def rank_only(scores: np.ndarray, actual: np.ndarray) -> dict[str, float]:
    return {"kendall_tau": kendall_tau(scores, actual), "spearman": spearman(scores, actual)}


def baselines(
    setup: Setup, splits: dict[str, list[LabeledRecord]], records: Sequence[LabeledRecord]
) -> dict[str, dict[str, Any]]:
    """The simple rivals, fitted on the train split, scored on `records`."""
    train = splits["train"]
    prompts = [r.prompt for r in records]
    actual = np.array([r.length for r in records], dtype=np.float64)
    tfidf = DEFAULT_FAST_OUT
    if setup.smoke or not reusable_artifact(tfidf, SERVED_FAST_SPEC, training_fingerprint(train)):
        tfidf = setup.work / "tfidf"
        if not reusable_artifact(tfidf, SERVED_FAST_SPEC, training_fingerprint(train)):
            data = TrainingSet(train, splits["validation"])
            train_artifact(SERVED_FAST_SPEC, data, tfidf, progress=_say)
    lengths = [r.length for r in train]
    train_prompts = [r.prompt for r in train]
    return {
        "tfidf_classifier": validation_scores(LengthPredictor.load(tfidf, threads=2), records)[
            "all"
        ],
        "tfidf_ridge": rank_only(fit_ridge(train_prompts, lengths).scores(prompts), actual),
        "tfidf_pairwise": rank_only(fit_pairwise(train_prompts, lengths).scores(prompts), actual),
        "prompt_length": rank_only(np.array([len(p) for p in prompts], dtype=float), actual),
    }


def aggregate(
    by_seed: dict[int, dict[str, dict[str, Any]]], simple: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """kendall_tau and spearman as {model: mean over seeds}, their [min, max], the paired
    difference per seed, the other measures' means, and which model is the default."""
    out: dict[str, Any] = {}
    seeds = sorted(by_seed)
    for metric in ("kendall_tau", "spearman", "mae_tokens", "p90_coverage", "accuracy"):
        values = {m: [by_seed[s][m]["all"][metric] for s in seeds] for m in MODELS}
        out[metric] = {m: float(np.mean(v)) for m, v in values.items()}
        out[metric] |= {name: s[metric] for name, s in simple.items() if metric in s}
        out[f"{metric}_min_max"] = {m: [min(v), max(v)] for m, v in values.items()}
        diffs = [a - b for a, b in zip(values["ranking"], values["classifier"], strict=True)]
        out[f"{metric}_ranking_minus_classifier"] = {
            "by_seed": diffs,
            "min_max": [min(diffs), max(diffs)],
        }
    corpora = sorted(set(by_seed[seeds[0]]["ranking"]) - {"all"})
    out["by_corpus"] = {
        m: {
            c: {
                k: float(np.mean([by_seed[s][m][c][k] for s in seeds]))
                for k in ("kendall_tau", "spearman")
            }
            for c in corpora
        }
        for m in MODELS
    }
    better = all(out[k]["ranking"] >= out[k]["classifier"] for k in ("kendall_tau", "spearman"))
    out["default"] = "ranking" if better else "classifier"
    return out


def evaluate(
    seeds: Sequence[int], records: Sequence[LabeledRecord], artifacts: dict[int, tuple[Path, Path]]
) -> dict[int, dict[str, dict[str, Any]]]:
    """Both models' scores per seed (the classifier, the same artifact each time, once)."""
    results: dict[int, dict[str, dict[str, Any]]] = {}
    classified: dict[Path, dict[str, Any]] = {}
    for seed in seeds:
        classifier, ranking = artifacts[seed]
        if classifier not in classified:
            loaded = LengthPredictor.load(classifier, threads=2)
            classified[classifier] = validation_scores(loaded, records)
        results[seed] = {
            "classifier": classified[classifier],
            "ranking": validation_scores(LengthPredictor.load(ranking, threads=2), records),
        }
        _say(
            f"seed {seed}: tau {results[seed]['ranking']['all']['kendall_tau']:.4f} ranking vs "
            f"{results[seed]['classifier']['all']['kendall_tau']:.4f} classifier"
        )
    return results


def heldout_records(labels_dir: Path, heldout_dir: Path | None) -> list[LabeledRecord]:
    """AlpacaEval's prompts with the served model's own answer lengths."""
    labels = read_labels(labels_dir)
    if not labels:
        raise SystemExit(
            f"{labels_dir} holds no labels: label the held-out prompts first "
            "(python -m predictor.label_served --heldout alpaca_eval --out DIR --device cuda)"
        )
    try:
        prompts = load_heldout(ALPACA_EVAL, heldout_dir)
    except DatasetError as exc:
        raise SystemExit(f"error: {exc}") from exc
    joined = join_records(prompts, labels)
    return [
        LabeledRecord(f"{r.corpus}:{r.index}", r.corpus, r.prompt, label.answer_tokens)
        for r, label in joined
    ]


def _artifacts(built: dict[int, tuple[Path, Path]]) -> dict[str, dict[str, Any]]:
    described: dict[str, dict[str, Any]] = {}
    for seed, (classifier, ranking) in built.items():
        rank = load_manifest(ranking)
        described[str(seed)] = {
            "classifier": load_manifest(classifier).version,
            "ranking": rank.version,
            "ranking_int8": rank.metrics.get("quantization", {}).get("used"),
            "ranking_head": rank.training.get("ranking", {}),
        }
    return described


def run(args: argparse.Namespace) -> tuple[str, dict[str, Any]] | None:
    setup = Setup(args.labels, args.data_dir, args.work_dir, args.smoke, args.limit)
    splits = setup.splits()
    data = TrainingSet(splits["train"], splits["validation"])
    if args.heldout:
        artifacts = built(setup, args.seeds)
        records = heldout_records(args.heldout_labels, args.heldout_dir)
        name, split = "predictor_rank_heldout", "heldout:alpaca_eval"
    else:
        classifier = build_classifier(setup, data)
        artifacts = {s: (classifier, build_ranking(setup, s, classifier, data)) for s in args.seeds}
        if args.build_only:
            return None
        records, name, split = splits["validation"], "predictor_rank", "validation"
    by_seed = evaluate(args.seeds, records, artifacts)
    simple = baselines(setup, splits, records)
    first = artifacts[args.seeds[0]]
    latency = single_prompt_ms(
        {"classifier": first[0], "ranking": first[1]}, [r.prompt for r in records]
    )
    payload: dict[str, Any] = {
        "split": split,
        "prompts": len(records),
        "train_prompts": len(splits["train"]),
        "seeds": list(args.seeds),
        **aggregate(by_seed, simple),
        "by_seed": {str(s): r for s, r in by_seed.items()},
        "baselines": simple,
        "artifacts": _artifacts(artifacts),
        "p50_ms_single_1thread": latency,
        "latency_note": f"seed {args.seeds[0]}'s ranking artifact against the classifier, "
        "single prompts of at most 256 characters, taking turns",
        "rank_config": setup.rank_config(0).to_json(),
        "labels": str(args.labels),
        "smoke": setup.smoke,
    }
    if args.heldout:
        payload["report_only"] = True
        made = read_manifest(args.heldout_labels)
        payload["note"] = (
            f"Held-out AlpacaEval prompts, labelled with {made.model}'s own answers (temperature "
            f"{made.temperature}, max_tokens {made.max_tokens}). Report-only: every setting was "
            "fixed on the validation split before this was run; nothing was chosen or tuned on it."
        )
    return name, payload


def markdown(payload: dict[str, Any]) -> str:
    names = [*MODELS, *payload["baselines"]]
    rows = []
    for name in names:
        span = payload["kendall_tau_min_max"].get(name)
        spread = payload["spearman_min_max"].get(name)
        rows.append(
            [
                name,
                payload["kendall_tau"][name],
                f"{span[0]:.3f}-{span[1]:.3f}" if span else "-",
                payload["spearman"][name],
                f"{spread[0]:.3f}-{spread[1]:.3f}" if spread else "-",
                payload["mae_tokens"].get(name, "-"),
                payload["p90_coverage"].get(name, "-"),
            ]
        )
    table = markdown_table(
        ["model", "Kendall tau", "min-max", "Spearman", "min-max", "MAE tokens", "p90 coverage"],
        rows,
    )
    tau = payload["kendall_tau_ranking_minus_classifier"]["min_max"]
    rho = payload["spearman_ranking_minus_classifier"]["min_max"]
    corpora = payload["by_corpus"]["ranking"]
    corpus_rows = [
        [
            c,
            corpora[c]["kendall_tau"],
            payload["by_corpus"]["classifier"][c]["kendall_tau"],
            corpora[c]["spearman"],
            payload["by_corpus"]["classifier"][c]["spearman"],
        ]
        for c in corpora
    ]
    return (
        (f"**Report only** ({payload['note']})\n\n" if payload.get("report_only") else "")
        + f"{payload['split']}: {payload['prompts']} prompts (trained on "
        f"{payload['train_prompts']}); seeds {payload['seeds']} (mean, min-max over seeds); "
        "lengths in the served model's tokens.\n\n"
        f"{table}\n\n"
        f"Ranking minus classifier, paired by seed: Kendall tau {tau[0]:+.4f} to {tau[1]:+.4f}, "
        f"Spearman {rho[0]:+.4f} to {rho[1]:+.4f}. Default: **{payload['default']}**.\n\n"
        f"One prompt, one thread, p50 ({payload['latency_note']}): "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in payload["p50_ms_single_1thread"].items())
        + ".\n\n"
        "By corpus (mean over seeds):\n\n"
        + markdown_table(
            ["corpus", "tau ranking", "tau classifier", "Spearman ranking", "Spearman classifier"],
            corpus_rows,
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.predictor.rank",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--results-dir", type=Path, default=results_dir("predictor"))
    parser.add_argument("--build-only", action="store_true", help="build the seeds' artifacts")
    parser.add_argument("--heldout", action="store_true", help="report on AlpacaEval (once)")
    parser.add_argument("--heldout-labels", type=Path, default=HELDOUT_LABELS)
    parser.add_argument("--heldout-dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny models, end to end")
    parser.add_argument("--limit", type=int, default=0, help="records per split (smoke)")
    args = parser.parse_args(argv)
    if args.work_dir is None:
        args.work_dir = WORK_DIR.with_name(WORK_DIR.name + "-smoke") if args.smoke else WORK_DIR
    outcome = run(args)
    if outcome is None:
        return
    name, payload = outcome
    text = markdown(payload)
    write_results(name, payload, text, command_line("bench.predictor.rank", argv), args.results_dir)
    print(text)


if __name__ == "__main__":
    main()
