"""When the gateway's drift signal fires on a traffic mix shift, and whether it clears once an
adapted predictor serves.

    python -m bench.predictor.drift_window [--labels predictor/labels/smollm2-135m-instruct]
        [--mode calibrate|retrain] [--every 50] [--cooldown 500]

"Served traffic" is SmolLM2-135M-Instruct's own answer lengths (the served-model labels), from
the labels' train split, in a fixed shuffled order: 1,000 Alpaca requests, then a shift to
another corpus (scenarios: GSM8K, a ranking shift at about the same mean length; LIMA, a scale
shift to answers twice as long). The predictor serving at the start (v1) is the served model's
predictor for Alpaca traffic: the scikit-learn kind (TF-IDF + logistic regression over quantile
buckets, trained in seconds) fitted on 3,000 other Alpaca samples. Every request is predicted
by the version serving then, and its (predicted, true) pair goes through the gateway's own
rolling-error code (gateway.prediction.drift, GATEWAY_DRIFT_* defaults): a window per version of
its newest samples, judged every `--every` requests. When the rule fires, a retrain job runs as
the gateway's worker runs one (predictor.retrain in the GATEWAY_RETRAIN_MODE default mode on
every sample served so far, then the activation gate); an activated candidate serves from the
next request and its window starts empty. A refused one leaves v1 serving; the next job waits
`--cooldown` requests (GATEWAY_RETRAIN_COOLDOWN_S, counted in requests).

The served-mean baseline is in every row (the window's served-mean MAE), and every version is
also scored on a fixed fresh split of the shifted corpus (the labels' test split) beside the
constant that predicts the mean of the samples it learned from.

Writes bench/results/predictor/drift_window.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import markdown_table, results_dir, write_results
from gateway.drift_settings import DriftSettings, RetrainSettings
from gateway.prediction.drift import DriftRule, rolling_error
from predictor.prepare import LabeledRecord
from predictor.retrain import retrain
from predictor.runtime import LengthPredictor
from predictor.served_labels import DEFAULT_LABELS, served_records
from predictor.training import TrainingSet, TrainSpec, train_artifact

BEFORE = ("alpaca", 1000)
SCENARIOS = {"gsm8k": 2500, "lima": 800}  # the corpus traffic shifts to, and its requests
V1_SAMPLES = 3000
Row = dict[str, Any]


def quiet(_: str) -> None:
    pass


@dataclass
class Serving:
    version: str
    artifact: Path
    predictor: LengthPredictor
    pairs: list[tuple[int, int]]  # its (predicted, true), oldest first

    @classmethod
    def load(cls, artifact: Path) -> Serving:
        predictor = LengthPredictor.load(artifact)
        return cls(predictor.version, artifact, predictor, [])


@dataclass(frozen=True)
class Data:
    by_corpus: dict[str, list[LabeledRecord]]  # train split, shuffled
    tests: dict[str, list[LabeledRecord]]  # test split
    v1: Path
    v1_mean: float  # the mean length v1 learned from


def load_data(labels: Path, data_dir: Path | None, work: Path) -> Data:
    splits = served_records(labels, data_dir)
    rng = random.Random(15)
    by_corpus: dict[str, list[LabeledRecord]] = {}
    for record in splits["train"]:
        by_corpus.setdefault(record.corpus, []).append(record)
    for records in by_corpus.values():
        rng.shuffle(records)
    tests: dict[str, list[LabeledRecord]] = {}
    for record in splits["test"]:
        tests.setdefault(record.corpus, []).append(record)
    trained = by_corpus["alpaca"][:V1_SAMPLES]
    validation = [r for r in splits["validation"] if r.corpus == "alpaca"][:500]
    v1 = work / "v1"
    spec = TrainSpec("sklearn", "quantile_n10")
    train_artifact(spec, TrainingSet(trained, validation), v1, progress=quiet)
    return Data(by_corpus, tests, v1, sum(r.length for r in trained) / len(trained))


def stream_of(data: Data, shift: str) -> list[LabeledRecord]:
    before = data.by_corpus[BEFORE[0]][V1_SAMPLES : V1_SAMPLES + BEFORE[1]]
    return before + data.by_corpus[shift][: SCENARIOS[shift]]


def fresh_scores(serving: LengthPredictor, test: list[LabeledRecord], mean: float) -> Row:
    expected = [p.expected_tokens for p in serving.predict_batch([r.prompt for r in test])]
    model = rolling_error([(round(e), r.length) for e, r in zip(expected, test, strict=True)])
    constant = sum(abs(mean - r.length) for r in test) / len(test)
    assert model is not None
    return {
        "mae_tokens": model.mae_tokens,
        "spearman": model.spearman,
        "served_mean_constant_mae_tokens": constant,
    }


@dataclass(frozen=True)
class Config:
    settings: DriftSettings
    every: int
    cooldown: int
    mode: str
    job_samples: int  # a job learns from the newest this many (0: all), GATEWAY_RETRAIN_MAX_SAMPLES


def replay(data: Data, shift: str, work: Path, config: Config) -> Row:
    """One scenario: every judgement of the window, every job, every version's fresh score."""
    settings, every, cooldown = config.settings, config.every, config.cooldown
    stream, test = stream_of(data, shift), data.tests[shift]
    rule = DriftRule(settings.min_samples, settings.max_mae_ratio, settings.min_spearman)
    serving = Serving.load(data.v1)
    versions = [
        {
            "version": serving.version,
            "from_request": 0,
            "fresh": fresh_scores(serving.predictor, test, data.v1_mean),
        }
    ]
    rows: list[Row] = []
    jobs: list[Row] = []
    served: list[tuple[str, int]] = []
    last_job = -cooldown
    for i, record in enumerate(stream, start=1):
        predicted = serving.predictor.predict(record.prompt).expected_tokens
        serving.pairs.append((round(predicted), record.length))
        served.append((record.prompt, record.length))
        if i % every:
            continue
        error = rolling_error(serving.pairs[-settings.window_samples :])
        drifted, reason = rule.verdict(error)
        phase = record.corpus
        rows.append(
            {
                "requests": i,
                "phase": phase,
                "version": serving.version,
                "drifted": drifted,
                "reason": reason,
                **(asdict(error) if error else {"samples": 0}),
            }
        )
        if drifted and i - last_job >= cooldown:
            last_job = i
            out = work / f"{shift}-job{len(jobs) + 1}"
            newest = served[-config.job_samples :] if config.job_samples else served
            job, adapted = run_job(newest, serving, out, i, config.mode)
            jobs.append(job)
            if adapted is not None:
                serving = adapted
                mean = sum(length for _, length in served) / len(served)
                versions.append(
                    {
                        "version": adapted.version,
                        "from_request": i,
                        "fresh": fresh_scores(adapted.predictor, test, mean),
                    }
                )
    return {
        "shift_to": shift,
        "requests": {BEFORE[0]: BEFORE[1], shift: SCENARIOS[shift]},
        "fresh_test_prompts": len(test),
        "summary": summary(rows, jobs, settings),
        "checks": rows,
        "jobs": jobs,
        "versions": versions,
    }


def run_job(
    served: list[tuple[str, int]], serving: Serving, out: Path, at: int, mode: str
) -> tuple[Row, Serving | None]:
    """What the gateway's retrain job does: every sample so far, newest first, the gate."""
    samples = list(reversed(served))
    report = retrain(samples, serving.artifact, out, mode=mode, progress=quiet)  # type: ignore[arg-type]
    job = {
        "at_request": at,
        "samples": report.samples,
        "activated": report.better,
        "reason": report.reason,
        "version": report.new_version,
        "seconds": round(report.seconds, 1),
        "gate": report.decision.to_json(),
    }
    return job, Serving.load(out) if report.better else None


def summary(rows: list[Row], jobs: list[Row], settings: DriftSettings) -> Row:
    """When the flag first fired, when a job activated a version, and when its flag cleared."""
    shift = BEFORE[1]
    fired = next((r["requests"] for r in rows if r["drifted"]), None)
    false_alarms = sum(r["drifted"] for r in rows if r["requests"] <= shift)
    activated = next((j["at_request"] for j in jobs if j["activated"]), None)
    cleared = None
    if activated is not None:
        cleared = next(
            (
                r["requests"]
                for r in rows
                if r["requests"] > activated
                and r["samples"] >= settings.min_samples
                and not r["drifted"]
            ),
            None,
        )
    return {
        "shift_at_request": shift,
        "drift_fired_at_request": fired,
        "fired_after_shift_requests": fired - shift if fired is not None else None,
        "drifted_checks_before_shift": false_alarms,
        "jobs": len(jobs),
        "activated_at_request": activated,
        "cleared_at_request": cleared,
        "drifted_at_end": rows[-1]["drifted"] if rows else None,
    }


def scenario_markdown(run: Row, table_every: int) -> str:
    s = run["summary"]
    header = ["requests", "phase", "version", "window", "MAE", "served-mean MAE", "ratio",
              "Spearman", "drifted"]  # fmt: skip
    table = [
        [r["requests"], r["phase"], r["version"][-8:], r["samples"], r.get("mae_tokens", ""),
         r.get("served_mean_mae_tokens", ""), r.get("mae_ratio", ""), r.get("spearman", ""),
         "yes" if r["drifted"] else ""]
        for r in run["checks"]
        if r["requests"] % table_every == 0
    ]  # fmt: skip
    jobs = [[j["at_request"], j["samples"], j["seconds"], "yes" if j["activated"] else "no",
             j["reason"]] for j in run["jobs"]]  # fmt: skip
    fresh = [[v["version"][-8:], v["from_request"], v["fresh"]["mae_tokens"],
              v["fresh"]["served_mean_constant_mae_tokens"], v["fresh"]["spearman"]]
             for v in run["versions"]]  # fmt: skip
    facts = (
        f"- drift fired at request {s['drift_fired_at_request']} "
        f"({s['fired_after_shift_requests']} requests after the shift); "
        f"drifted checks before the shift: {s['drifted_checks_before_shift']}\n"
        f"- retrain jobs: {s['jobs']}; first activation at request {s['activated_at_request']}; "
        f"the flag cleared at request {s['cleared_at_request']}; "
        f"drifted at the end: {s['drifted_at_end']}"
    )
    return "\n\n".join([
        f"## Alpaca -> {run['shift_to']} (shift after request {s['shift_at_request']})",
        facts,
        markdown_table(header, table),
        "Retrain jobs (the newest served samples, then the gate):",
        markdown_table(["at request", "samples", "seconds", "activated", "gate"], jobs),
        f"Each version on a fixed fresh {run['shift_to']} split ({run['fresh_test_prompts']} "
        "prompts of the labels' test split):",
        markdown_table(["version", "serving from", "MAE", "served-mean constant MAE",
                        "Spearman"], fresh),
    ])  # fmt: skip


def markdown(payload: Row) -> str:
    cfg = payload["settings"]
    intro = (
        f"`{payload['command']}`. Window: the last {cfg['window_samples']} requests of the "
        f"serving version, judged every {payload['every']} requests; drifted when MAE >= "
        f"{cfg['max_mae_ratio']}x the window's served-mean MAE or Spearman < "
        f"{cfg['min_spearman']}, with >= {cfg['min_samples']} samples (the gateway's defaults). "
        f"Jobs: mode `{payload['mode']}`, learning from "
        f"{payload['job_samples'] or 'all'} newest samples, at most one per "
        f"{payload['cooldown_requests']} requests. v1: {payload['v1']} trained on "
        f"{V1_SAMPLES} Alpaca samples."
    )
    parts = ["# Drift signal on a mix shift, SmolLM2-135M-Instruct's answer lengths", intro]
    parts += [scenario_markdown(run, payload["table_every"]) for run in payload["scenarios"]]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.predictor.drift_window")
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--mode", choices=("calibrate", "retrain"), default=RetrainSettings().mode)
    parser.add_argument("--every", type=int, default=50, help="requests between judgements")
    parser.add_argument("--cooldown", type=int, default=500, help="requests between jobs")
    parser.add_argument(
        "--job-samples", type=int, default=0, help="jobs learn from the newest N (0: all)"
    )
    args = parser.parse_args(argv)
    settings = DriftSettings()
    config = Config(settings, args.every, args.cooldown, args.mode, args.job_samples)
    with tempfile.TemporaryDirectory(prefix="drift-window-") as tmp:
        data = load_data(args.labels, args.data_dir, Path(tmp))
        runs = [replay(data, shift, Path(tmp), config) for shift in SCENARIOS]
    command = (
        "python -m bench.predictor.drift_window"
        + (f" --mode {args.mode}" if args.mode != RetrainSettings().mode else "")
        + (f" --job-samples {args.job_samples}" if args.job_samples else "")
    )
    payload = {
        "command": command,
        "settings": asdict(settings),
        "every": args.every,
        "cooldown_requests": args.cooldown,
        "mode": args.mode,
        "job_samples": args.job_samples,
        "v1": "scikit-learn TF-IDF + logistic regression, quantile_n10",
        "v1_alpaca_samples": V1_SAMPLES,
        "scenarios": runs,
        "table_every": 250,
    }
    write_results("drift_window", payload, markdown(payload), command, results_dir("predictor"))
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
