"""Choosing the retrain's configuration and the adaptation bench's base, on a validation split.

    python -m bench.predictor.adapt_sweep [--device cuda] [--samples 600] [--variants a,b]
        [--out DIR]

The choices of bench.predictor.adapt (which base it starts from) and of predictor.retrain
(DEFAULT_RETRAIN: epochs, learning rates, loss, weight interpolation, calibration samples) are
made here, never on the bench's test split: the served traffic is the same shuffled train split
of the served model's labels as in the bench (same seed), and the validation ("dev") prompts are
that stream's last `--dev-prompts` records, which the bench never sees (its curves read the
first 2,000; its test split is the labels' test split). Each variant is retrained on two sample
sets of `--samples` records each: the bench's own first samples (stream[:n]) and
stream[2000:2000+n], and scored on the dev prompts: Spearman and MAE of the calibrated expected
length (what the gateway serves), Spearman of the raw expected length, p90 coverage, and the
gate's verdict. The base alone, calibration alone, TF-IDF and the samples' mean are scored on the
same prompts for reference.

Writes DIR/predictor_adapt_sweep.{json,md} (bench/results/predictor by default) after every variant.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import markdown_table, results_dir
from bench.predictor.adapt import base_predictor, base_spec, retrained, scored, served_stream
from predictor.evaluate import spearman
from predictor.gate import constant_rival
from predictor.prepare import LabeledRecord
from predictor.retrain import RetrainConfig
from predictor.runtime import LengthPredictor
from predictor.served_labels import DEFAULT_LABELS, served_records
from predictor.tfidf_length import fit_tfidf_length

# The retrain as the previous session left it (written out: it keeps its meaning if the
# defaults change).
BEFORE = RetrainConfig(
    examples_goal=2400,
    min_epochs=2,
    max_epochs=8,
    learning_rate=1e-4,
    head_learning_rate=2e-3,
    freeze_embeddings=True,
    length_loss_weight=0.0,
    warm_start_keep=0.0,
    calibration_samples="fit",
)
# name -> (base, retrain configuration); in the order they run (the first matter most).
VARIANTS: dict[str, tuple[str, RetrainConfig]] = {
    "4k/before": ("4k", BEFORE),
    "default/before": ("default", BEFORE),
    "default/len10": ("default", replace(BEFORE, length_loss_weight=10.0)),
    "default/keep0.3": ("default", replace(BEFORE, warm_start_keep=0.3)),
    "default/keep0.5": ("default", replace(BEFORE, warm_start_keep=0.5)),
    "default/lr_low": ("default", replace(BEFORE, learning_rate=5e-5, head_learning_rate=1e-3)),
    "default/lr_high": ("default", replace(BEFORE, learning_rate=2e-4, head_learning_rate=4e-3)),
    "default/goal4800": ("default", replace(BEFORE, examples_goal=4800, max_epochs=16)),
    "default/goal1200": ("default", replace(BEFORE, examples_goal=1200)),
    "default/unfrozen": ("default", replace(BEFORE, freeze_embeddings=False)),
    "default/calib_val": ("default", replace(BEFORE, calibration_samples="validation")),
    "default/len10_keep0.3": (
        "default",
        replace(BEFORE, length_loss_weight=10.0, warm_start_keep=0.3),
    ),
    "default/len10_unfrozen": (
        "default",
        replace(BEFORE, length_loss_weight=10.0, freeze_embeddings=False),
    ),
    "4k/len10": ("4k", replace(BEFORE, length_loss_weight=10.0)),
    "4k/keep0.3": ("4k", replace(BEFORE, warm_start_keep=0.3)),
}
SECOND_STREAM_START = 2000  # the bench's curves read stream[:2000]
Row = dict[str, Any]


def dev_scores(path: Path, dev: Sequence[LabeledRecord], threads: int) -> Row:
    """What the gateway would serve (calibrated when the artifact holds a calibration), plus
    the raw expected length's Spearman."""
    predictor = LengthPredictor.load(path, threads=threads)
    served = predictor.lengths([r.prompt for r in dev])
    row = scored(served.expected_tokens, served.p90_tokens, dev)
    # The ranking value is the raw expected length for a classifier (a ranking head's score
    # otherwise): the same order as before calibration.
    raw = served.rank_score
    row["raw_spearman"] = spearman(raw, np.array([r.length for r in dev], dtype=np.float64))
    return row


def sample_sets(stream: list[LabeledRecord], n: int) -> list[list[LabeledRecord]]:
    return [stream[:n], stream[SECOND_STREAM_START : SECOND_STREAM_START + n]]


def summary(rows: list[Row]) -> list[list[object]]:
    """One line per variant: its scores averaged over the sample sets."""
    names = list(dict.fromkeys(r["variant"] for r in rows))
    lines: list[list[object]] = []
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        mean = {
            k: float(np.mean([r[k] for r in mine if r.get(k) is not None]))
            for k in ("spearman", "raw_spearman", "mae_tokens", "p90_coverage")
            if any(r.get(k) is not None for r in mine)
        }
        lines.append(
            [
                name,
                len(mine),
                mean.get("spearman", float("nan")),
                mean.get("raw_spearman", float("nan")),
                mean.get("mae_tokens", float("nan")),
                mean.get("p90_coverage", float("nan")),
                " ".join(f"{r['spearman']:.3f}" for r in mine),
                sum(bool(r.get("activated")) for r in mine),
            ]
        )
    return lines


def write(out: Path, payload: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "predictor_adapt_sweep.json").write_text(json.dumps(payload, indent=2) + "\n")
    table = markdown_table(
        [
            "variant",
            "sample sets",
            "Spearman",
            "raw Spearman",
            "MAE tokens",
            "p90 coverage",
            "Spearman per set",
            "activated",
        ],
        summary(payload["rows"]),
    )
    text = [
        "# predictor_adapt_sweep",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Device: {payload['device']}; {payload['samples']} served samples per set, two sets;"
        f" scored on {payload['dev_prompts']} validation prompts of the labels' train split"
        " (never the bench's test split). Means over the sets.",
        "",
        table,
        "",
    ]
    (out / "predictor_adapt_sweep.md").write_text("\n".join(text))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.predictor.adapt_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--dev-prompts", type=int, default=1500)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime threads for scoring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=results_dir("predictor"))
    parser.add_argument("--time-budget", type=float, default=0, help="seconds; 0: no limit")
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    started = time.monotonic()
    splits = served_records(args.labels, args.data_dir)
    stream = served_stream(splits["train"], random.Random(args.seed))  # the bench's order
    dev = stream[-args.dev_prompts :]
    sets = sample_sets(stream, args.samples)
    assert not {r.prompt for s in sets for r in s} & {r.prompt for r in dev}
    given = list(sys.argv[1:] if argv is None else argv)
    payload: dict[str, Any] = {
        "command": " ".join(["python -m bench.predictor.adapt_sweep", *given]),
        "device": args.device,
        "samples": args.samples,
        "dev_prompts": len(dev),
        "variants": {n: {"base": VARIANTS[n][0], "config": asdict(VARIANTS[n][1])} for n in names},
        "bases": {},
        "rows": [],
    }
    bases_needed = list(dict.fromkeys(VARIANTS[n][0] for n in names))
    bases: dict[str, Path] = {}
    for name in bases_needed:
        t0 = time.monotonic()
        bases[name] = base_predictor(args.data_dir, name, args.device)
        payload["bases"][name] = {
            "spec": base_spec(name, args.device).config_json(),
            "seconds": round(time.monotonic() - t0, 1),
        }
        payload["rows"].append(
            {"variant": f"{name}/base alone", "set": None, **dev_scores(bases[name], dev, 2)}
        )
    for i, samples in enumerate(sets):
        lengths = [r.length for r in samples]
        tfidf = fit_tfidf_length([r.prompt for r in samples], lengths)
        expected, p90 = tfidf.predict([r.prompt for r in dev])
        payload["rows"].append({"variant": "tfidf", "set": i, **scored(expected, p90, dev)})
        payload["rows"].append(
            {"variant": "served_mean", "set": i, **scored(*constant_rival(lengths, len(dev)), dev)}
        )
    write(args.out, payload)
    with tempfile.TemporaryDirectory(prefix="adapt-sweep-") as tmp:
        for name in bases_needed:
            for i, samples in enumerate(sets):
                out = Path(tmp) / f"{name}-calibrate-{i}"
                retrained(samples, bases[name], out, "calibrate", args.device)
                payload["rows"].append(
                    {"variant": f"{name}/calibration", "set": i, **dev_scores(out, dev, 2)}
                )
        for name in names:
            if args.time_budget and time.monotonic() - started > args.time_budget:
                payload.setdefault("skipped", []).append(name)
                continue
            base_name, config = VARIANTS[name]
            for i, samples in enumerate(sets):
                out = Path(tmp) / f"{name.replace('/', '-')}-{i}"
                report = retrained(samples, bases[base_name], out, "retrain", args.device, config)
                row = {
                    "variant": name,
                    "set": i,
                    **dev_scores(out, dev, args.threads),
                    "activated": report.better,
                    "seconds": report.seconds,
                }
                payload["rows"].append(row)
                print(name, i, {k: row[k] for k in ("spearman", "mae_tokens", "seconds")})
            write(args.out, payload)
    payload["seconds"] = round(time.monotonic() - started, 1)
    write(args.out, payload)
    print((args.out / "predictor_adapt_sweep.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
