"""How fast the length predictor learns a served model from its traffic, and recovers from drift.

    python -m bench.predictor.adapt [--labels predictor/labels/smollm2-135m-instruct]
        [--checkpoints 0,100,300,600,2000] [--test-prompts 1500] [--base default|4k]
        [--device cpu|cuda]

The "served traffic" is the served model's own labels (predictor.label_served: SmolLM2's greedy
answer lengths), arriving in a fixed shuffled order from the labels' train split. The base is a
predictor that never saw that model: trained on the corpora's reference answers (GPT-2 tokens of
text-davinci-003 and others), like a deployment's first version. By default it is trained like
the default predictor (predictor.build_default), the version a deployment starts from; `--base
4k` is that configuration on 4,000 prompts (a proxy that builds in minutes on two cores).
`--device cuda` fine-tunes the base and every retrain on a GPU (minutes in all; on two CPU cores
the default base alone takes ~20 minutes). After every checkpoint's number of samples, in one run:
- `retrain`: predictor.retrain mode "retrain" (warm-started fine-tune, then calibration);
- `calibration`: mode "calibrate" (the base model, a new calibration map);
- `tfidf`: TF-IDF + ridge fitted on the samples so far;
- `served_mean`: the samples' mean (p90: their p90);
- `served`: what a gateway would serve, the newest candidate the gate activated (else the one
  before, starting from the base),
all scored on a fixed test split (the labels' test split: prompts no method trained or chose on).
The base and the retrain's configuration were chosen on a validation split of the labels' train
split (bench.predictor.adapt_sweep, at git tag study/predictor-choices;
bench/results/predictor/predictor_adapt_sweep.md).

Drift: the stream then shifts corpus (Alpaca -> Dolly -> LIMA + GSM8K, 600 samples each); at each
phase's end, on that phase's test prompts: a calibration fitted on Alpaca alone (stale) and one
refitted on the last 600 samples; the model retrained on Alpaca alone (stale) and one retrained
on the last 600 samples (warm-started from the base); the window's served mean.

Writes bench/results/predictor/predictor_adapt.{json,md,png}.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import markdown_table, results_dir, write_results
from predictor.build_default import DEFAULT_OUT, DEFAULT_SPEC
from predictor.calibrate import write_calibrated
from predictor.calibration import Calibration, fit_calibration
from predictor.gate import constant_rival, score
from predictor.prepare import LabeledRecord, prepare, training_fingerprint
from predictor.retrain import DEFAULT_RETRAIN, Mode, RetrainConfig, RetrainReport, retrain
from predictor.runtime import LengthPredictor
from predictor.served_labels import DEFAULT_LABELS, served_records
from predictor.tfidf_length import fit_tfidf_length
from predictor.training import TrainSpec, reusable_artifact, train_artifact

_REPO = Path(__file__).resolve().parents[2]
# The bases a run can start from, both trained on the corpora's reference answers:
# - "default": the default predictor's own configuration (predictor.build_default: 20,000
#   reference prompts, one epoch), the version a deployment starts from (~20 minutes on two
#   cores, under a minute on a GPU);
# - "4k": that configuration on 4,000 prompts, a proxy built in minutes on two cores.
BASE_SPECS = {
    "default": DEFAULT_SPEC,
    "4k": replace(DEFAULT_SPEC, finetune=replace(DEFAULT_SPEC.finetune, max_train=4000)),
}
DEFAULT_BASE = "default"
# The default base is the demo's artifact directory: one that `python -m predictor.build_default`
# (`make demo`) built from the same data is reused, and one built here is what it would build.
BASE_DIRS = {
    "default": DEFAULT_OUT,
    "4k": _REPO / "var" / "predictor" / "reference-4k",
}
METHODS = ("retrain", "calibration", "tfidf", "served_mean", "served")
DRIFT_PHASES = (("alpaca",), ("dolly",), ("lima", "gsm8k"))
PHASE_SAMPLES = 600
RETRAIN_MODE: Mode = "retrain"  # the retrain curve's mode (a test of the pipeline swaps it)
Row = dict[str, Any]


def quiet(_: str) -> None:
    pass


def base_spec(name: str = DEFAULT_BASE, device: str = "cpu") -> TrainSpec:
    spec = BASE_SPECS[name]
    return replace(spec, finetune=replace(spec.finetune, device=device))


def base_predictor(data_dir: Path | None, name: str = DEFAULT_BASE, device: str = "cpu") -> Path:
    """The base artifact (built, or reused when its data and configuration are the same)."""
    data = prepare(data_dir, None, None, quiet)
    spec, out = base_spec(name, device), BASE_DIRS[name]
    if device != "cpu":  # a GPU-trained base is not the demo's artifact: a directory of its own
        out = out.with_name(f"{out.name}-{device}")
    if reusable_artifact(out, spec, training_fingerprint(data.train)) is None:
        from predictor.train import training_set

        print(f"building the reference base predictor ({name}) in {out}", flush=True)
        train_artifact(spec, training_set(data, data_dir), out, progress=print)
    return out


def served_stream(train: Sequence[LabeledRecord], rng: random.Random) -> list[LabeledRecord]:
    """The "served traffic": the labels' train split in the seed's first shuffle (the sweep that
    chose the bench's configuration reads the same order)."""
    stream = list(train)
    rng.shuffle(stream)
    return stream


def retrained(
    samples: Sequence[LabeledRecord],
    base: Path,
    out: Path,
    mode: Mode,
    device: str,
    config: RetrainConfig = DEFAULT_RETRAIN,
) -> RetrainReport:
    """predictor.retrain on the samples, quietly."""
    pairs = [(r.prompt, r.length) for r in samples]
    return retrain(pairs, base, out, mode=mode, config=config, device=device, progress=quiet)


def scored(expected: np.ndarray, p90: np.ndarray, test: Sequence[LabeledRecord]) -> Row:
    scores = score(expected, p90, [r.length for r in test])
    return {
        "spearman": scores.spearman,
        "mae_tokens": scores.mae_tokens,
        "p90_coverage": scores.p90_coverage,
        "mean_predicted": scores.mean_predicted,
    }


def artifact_scores(path: Path, test: Sequence[LabeledRecord]) -> Row:
    predictions = LengthPredictor.load(path, threads=2).predict_batch([r.prompt for r in test])
    return scored(
        np.array([p.expected_tokens for p in predictions]),
        np.array([p.p90_tokens for p in predictions], dtype=np.float64),
        test,
    )


def learning_curves(
    stream: list[LabeledRecord],
    test: list[LabeledRecord],
    base: Path,
    checkpoints: list[int],
    work: Path,
    device: str = "cpu",
    config: RetrainConfig = DEFAULT_RETRAIN,
) -> tuple[dict[str, list[Row]], list[Row]]:
    curves: dict[str, list[Row]] = {m: [] for m in METHODS}
    decisions: list[Row] = []
    base_scores = artifact_scores(base, test)
    served = base
    for n in checkpoints:
        print(f"checkpoint {n} samples", flush=True)
        if n == 0:
            for method in ("retrain", "calibration", "served"):
                curves[method].append({"samples": 0, **base_scores})
            continue
        seen = stream[:n]
        modes: tuple[tuple[str, Mode], ...] = (
            ("calibration", "calibrate"),
            ("retrain", RETRAIN_MODE),
        )
        for method, mode in modes:
            out = work / f"{mode}-{n}"
            report = retrained(seen, base, out, mode, device, config)
            curves[method].append(
                {"samples": n, **artifact_scores(out, test), "seconds": report.seconds}
            )
            decisions.append({"samples": n, "method": method, **report.decision.to_json()})
            if report.better:
                served = out
        curves["served"].append(
            {"samples": n, **artifact_scores(served, test), "version": served.name}
        )
        lengths = [r.length for r in seen]
        tfidf = fit_tfidf_length([r.prompt for r in seen], lengths)
        curves["tfidf"].append(
            {"samples": n, **scored(*tfidf.predict([r.prompt for r in test]), test)}
        )
        curves["served_mean"].append(
            {"samples": n, **scored(*constant_rival(lengths, len(test)), test)}
        )
    return curves, decisions


def drift(
    train: list[LabeledRecord],
    test: list[LabeledRecord],
    base: Path,
    work: Path,
    seed: int,
    phase_samples: int = PHASE_SAMPLES,
    device: str = "cpu",
    config: RetrainConfig = DEFAULT_RETRAIN,
) -> list[Row]:
    """At each phase's end, on that phase's test prompts: the calibration fitted in the first
    phase (stale) and one refitted on the window of the last `phase_samples` samples; the model
    retrained in the first phase (stale) and one retrained on the window (warm-started from the
    base, as the gateway's retrain after drift does); the window's mean."""
    rng = random.Random(seed)
    predictor = LengthPredictor.load(base, threads=2)
    stale: Calibration | None = None
    stale_model: Path | None = None
    rows: list[Row] = []
    seen: list[LabeledRecord] = []
    for corpora in DRIFT_PHASES:
        pool = [r for r in train if r.corpus in corpora]
        rng.shuffle(pool)
        seen += pool[:phase_samples]
        window = seen[-phase_samples:]
        phase_test = [r for r in test if r.corpus in corpora]
        raw = predictor.raw_expected([r.prompt for r in window])
        fresh = fit_calibration(raw, [r.length for r in window], "window")
        stale = stale or fresh
        name = "+".join(corpora)
        row: dict[str, Any] = {
            "phase": name,
            "samples_seen": len(seen),
            "test_prompts": len(phase_test),
        }
        test_raw = predictor.raw_expected([r.prompt for r in phase_test])
        for label, calibration in (("stale_calibration", stale), ("recalibrated", fresh)):
            row[label] = scored(*calibration.apply(test_raw), phase_test)
        write_calibrated(base, work / f"drift-{name}", fresh)  # the artifact loads like any other
        window_model = work / f"drift-retrain-{name}"
        report = retrained(window, base, window_model, RETRAIN_MODE, device, config)
        stale_model = stale_model or window_model
        row["stale_retrained"] = artifact_scores(stale_model, phase_test)
        row["retrained"] = {**artifact_scores(window_model, phase_test), "activated": report.better}
        row["window_mean"] = scored(
            *constant_rival([r.length for r in window], len(phase_test)), phase_test
        )
        rows.append(row)
    return rows


def plot(curves: dict[str, list[Row]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in zip(
        axes,
        ("spearman", "mae_tokens", "p90_coverage"),
        ("Spearman", "MAE (tokens)", "p90 coverage"),
        strict=True,
    ):
        for method, points in curves.items():
            xs = [max(p["samples"], 30) for p in points]
            ax.plot(xs, [p[key] for p in points], marker="o", label=method)
        ax.set_xscale("log")
        ax.set_xlabel("served samples seen (0 drawn at 30)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Length predictor learning the served model (SmolLM2-135M) from its traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(
    curves: dict[str, list[Row]], decisions: list[Row], drift_rows: list[Row], notes: str = ""
) -> str:
    rows = [
        [method, p["samples"], p["spearman"], p["mae_tokens"], p["p90_coverage"]]
        for method, points in curves.items()
        for p in points
    ]
    parts = [notes] if notes else []
    parts.append(
        markdown_table(["method", "samples", "Spearman", "MAE tokens", "p90 coverage"], rows)
    )
    parts.append("\nGate decisions (gate split of the samples seen, never trained on):\n")
    parts.append(
        markdown_table(
            ["samples", "candidate", "activated", "reason"],
            [[d["samples"], d["method"], d["activate"], d["reason"]] for d in decisions],
        )
    )
    parts.append(
        "\nDrift (600 samples per phase; scored on that phase's test prompts). Stale: fitted in"
        " the first phase (Alpaca); recalibrated / retrained: on the window of the last 600"
        " samples (the retrain warm-started from the base):\n"
    )
    drift_methods = (
        ("stale_calibration", "stale calibration"),
        ("recalibrated", "recalibrated"),
        ("stale_retrained", "stale retrain"),
        ("retrained", "retrained"),
        ("window_mean", "window mean"),
    )
    parts.append(
        markdown_table(
            ["phase", "method", "Spearman", "MAE tokens", "p90 coverage"],
            [
                [
                    r["phase"],
                    label,
                    r[key]["spearman"],
                    r[key]["mae_tokens"],
                    r[key]["p90_coverage"],
                ]
                for r in drift_rows
                for key, label in drift_methods
                if key in r
            ],
        )
    )
    parts.append("\n![curves](predictor_adapt.png)")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.predictor.adapt",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--checkpoints", default="0,100,300,600,2000")
    parser.add_argument("--test-prompts", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--base",
        choices=sorted(BASE_SPECS),
        default=DEFAULT_BASE,
        help="the reference predictor every method starts from (see BASE_SPECS)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the base and the retrains are fine-tuned: cpu (two cores: hours) or cuda",
    )
    args = parser.parse_args(argv)
    checkpoints = sorted({int(c) for c in args.checkpoints.split(",")})
    base = base_predictor(args.data_dir, args.base, args.device)
    splits = served_records(args.labels, args.data_dir)
    rng = random.Random(args.seed)
    stream = served_stream(splits["train"], rng)
    test = list(splits["test"])
    rng.shuffle(test)
    test = test[: args.test_prompts]
    with tempfile.TemporaryDirectory(prefix="adapt-") as tmp:
        work = Path(tmp)
        curves, decisions = learning_curves(
            stream, test, base, checkpoints, work, device=args.device
        )
        drift_rows = drift(
            splits["train"], splits["test"], base, work, args.seed, device=args.device
        )
    folder = results_dir("predictor")
    folder.mkdir(parents=True, exist_ok=True)
    plot(curves, folder / "predictor_adapt.png")
    payload = {
        "curves": curves,
        "gate_decisions": decisions,
        "drift": drift_rows,
        "base": {
            "version": LengthPredictor.load(base).version,
            "name": args.base,
            "spec": base_spec(args.base, args.device).config_json(),
            "trained_on": "the corpora's reference answers (GPT-2 tokens)",
        },
        "retrain_config": asdict(DEFAULT_RETRAIN),
        "device": args.device,
        "labels": str(args.labels),
        "test_prompts": len(test),
        "stream": "labels' train split, shuffled (seed)",
        "seed": args.seed,
        "checkpoints": checkpoints,
    }
    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m bench.predictor.adapt", *given])
    notes = (
        f"Base: `{args.base}` ({BASE_SPECS[args.base].finetune.max_train} reference prompts,"
        f" {BASE_SPECS[args.base].finetune.epochs} epoch), fine-tuned on `{args.device}` like"
        f" every retrain; {len(test)} test prompts (the labels' test split), served samples from"
        " the labels' train split. The base and the retrain configuration were chosen on a"
        " validation split carved from the labels' train split, never on this test split"
        " (`bench.predictor.adapt_sweep` at git tag study/predictor-choices,"
        " predictor_adapt_sweep.md).\n"
    )
    text = markdown(curves, decisions, drift_rows, notes)
    write_results("predictor_adapt", payload, text, command, folder)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
