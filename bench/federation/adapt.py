"""The predictor adapted from served traffic, as an operator adapts it (issue 34).

One of our gateways, routing with `completion_cost` and the base predictor, serves the `text`
workload's train split through the same sites (open loop) and records every finished answer as
a length sample (GATEWAY_COLLECT_SAMPLES); then `python -m gateway.retrain_predictor` builds a
candidate from that gateway's database, gated against the base. The candidate is what the
`completion_cost_adapted` arm serves, whatever the gate said: the report gives the gate's
verdict beside the arm (a deployment with `--activate if-better` would keep the base where the
gate refuses).

The replay ends every answer at max_tokens (its true length, at the preset's answer scale), so
every sample is marked censored; `--include-censored` takes them, since the length is the truth.
The candidate therefore learns the lengths at the scale the sites answered them (an eighth at
CPU scale), as a deployment's predictor learns its served model's lengths.

Also scored offline on the measured prompts (the test split, never served here): Spearman and
the MAE of expected tokens, base against candidate, in the replayed lengths.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.federation.cluster import ARMS, Federation
from bench.federation.loadgen import run_open_loop
from bench.federation.workload import Request
from predictor.evaluate import spearman
from predictor.runtime import LengthPredictor

SERVING_ARM = "completion_cost"
SERVING_LABEL = "adapt_serving"


def serve_and_retrain(
    federation: Federation,
    weights: Mapping[str, float],
    served: Sequence[Request],
    *,
    base: Path,
    out: Path,
    mode: str,
    drain_s: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Serves `served` through a sample-collecting gateway, then retrains from its database into
    `out`; what happened, for the report."""
    started = time.monotonic()
    gateway = federation.start_gateway(
        ARMS[SERVING_ARM], weights, env={"GATEWAY_COLLECT_SAMPLES": "true"}, label=SERVING_LABEL
    )
    try:
        log(f"adaptation: serving {len(served)} train-split prompts with the base predictor")
        outcomes = asyncio.run(run_open_loop(gateway.base_url, served, drain_s)).outcomes
    finally:
        federation.stop_gateway(gateway)
    answered = sum(1 for o in outcomes if o.ok)
    command = [
        sys.executable, "-m", "gateway.retrain_predictor",
        "--database-url", gateway.database_url,
        "--base", str(base), "--out", str(out), "--mode", mode,
        "--include-censored", "--activate", "if-better",
    ]  # fmt: skip
    log(f"adaptation: {answered} answered; {' '.join(command[1:])}")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0 or not (out / "manifest.json").is_file():
        raise RuntimeError(f"the retrain failed (exit {done.returncode}):\n{output[-3000:]}")
    log(f"adaptation: {output.splitlines()[-1] if output else 'done'}")
    return {
        "mode": mode,
        "served_requests": len(served),
        "answered": answered,
        "base": str(base),
        "adapted": str(out),
        "retrain_output": output.splitlines()[-12:],
        "seconds": round(time.monotonic() - started, 1),
    }


def offline_scores(
    predictors: Mapping[str, Path], prompts: Sequence[str], lengths: Sequence[int]
) -> dict[str, dict[str, float]]:
    """Each predictor's Spearman and MAE of expected tokens against `lengths` on `prompts`."""
    truth = np.asarray(lengths, dtype=np.float64)
    scores: dict[str, dict[str, float]] = {}
    for name, path in predictors.items():
        predictor = LengthPredictor.load(path, threads=1)
        expected = np.asarray(
            [p.expected_tokens for p in predictor.predict_batch(list(prompts))], dtype=np.float64
        )
        scores[name] = {
            "spearman": round(spearman(expected, truth), 3),
            "mae_tokens": round(float(np.abs(expected - truth).mean()), 1),
            "mean_expected": round(float(expected.mean()), 1),
        }
    # The best constant, the measured lengths' own mean: what no predictor can know beforehand.
    scores["constant_mean"] = {
        "spearman": 0.0,
        "mae_tokens": round(float(np.abs(truth.mean() - truth).mean()), 1),
        "mean_expected": round(float(truth.mean()), 1),
    }
    return scores
