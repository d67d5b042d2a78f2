"""python -m fedsim.calibrate [--grid bench/results/sim/step_grid_<gpu>.json ...]

Fits the step-time model per (card, model shape) on the step grid(s) given, and on the measured
steps bench/results already holds; reports each fit's error on held-out steps; replays measured
GPU runs (replay.py); writes bench/results/sim/calibration_<gpu>.{json,md} and the fitted models
the simulator loads (bench/results/sim/step_models.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedsim.calibrate.fit import Fitted, existing_observations, fit_all, grid_observations
from fedsim.calibrate.host import engine_step_rows, fit_host
from fedsim.calibrate.replay import compare, fit_admitting, measured_runs
from fedsim.step_time import StepTimeModel

# The run the admitting steps' KV term is fitted on (the newest engine's 1,000-request burst):
# FITTING ONLY, its errors are reported apart, never as replay_error. The 3,000- and
# 4,500-request bursts and the Poisson runs are the checks.
FIT_RUN = "serving_burst"

REPO = Path(__file__).resolve().parent.parent.parent
RESULTS = REPO / "bench" / "results"
STEP_MODELS = RESULTS / "sim" / "step_models.json"


def _markdown(
    fits: Sequence[Fitted], replays: dict[str, Any], command: str, fitted: Sequence[str] = ()
) -> str:
    lines = [
        "# Simulator calibration",
        "",
        f"Command: `{command}`",
        "",
        "## Step-time model, error on held-out steps",
        "",
        "| card | model | train rows | held-out rows | error p50 | p90 | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in fits:
        lines.append(
            f"| {f.card} | {f.model} | {f.train_rows} | {f.held_out_rows} | "
            f"{f.error_p50:.3f} | {f.error_p90:.3f} | {f.error_max:.3f} |"
        )
    lines += [
        "",
        "## Replays of measured GPU runs",
        "",
        "| run | metric | measured | simulated | error |",
        "|---|---|---|---|---|",
    ]
    for name, replay in replays.items():
        for key, measured in replay["measured"].items():
            simulated = replay["simulated"][key]
            error = replay["relative_error"].get(key, float("nan"))
            label = f"{name} (admitting term fitted on it)" if name in fitted else name
            lines.append(f"| {label} | {key} | {measured:.4f} | {simulated:.4f} | {error:.3f} |")
    return "\n".join(lines) + "\n"


def _with_admitting(fit: Fitted, fitted_on: StepTimeModel) -> Fitted:
    """The admitting host term (measured on the H200's 1B shape only) on another card and
    shape, as it is: a host's cost a step, not scaled (not measured there)."""
    term = fitted_on.host.admitting_step_s
    return replace(fit, step=replace(fit.step, host=replace(fit.step.host, admitting_step_s=term)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.calibrate")
    parser.add_argument("--grid", type=Path, nargs="*", default=[])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--shared", type=Path, default=REPO.parent / "shared")
    parser.add_argument("--out", type=Path, default=RESULTS / "sim")
    parser.add_argument("--gpu", default=None, help="the file's label (default: the grid's card)")
    parser.add_argument(
        "--engine-run",
        type=Path,
        default=None,
        help="a newer engine's bench.engine.gpu file (1,000-request burst, Poisson run, decode "
        "sweep): its sweep sets the host term, its burst the admitting term; the engine_h200_r* "
        "files beside it are the checks (default: engine/engine_h200_20261127.json and the "
        "serving burst)",
    )
    args = parser.parse_args(argv)
    observations = existing_observations(args.results)
    for grid in args.grid:
        observations += grid_observations(grid)
    # The held-out error is the kernel model's (the grid's rows are synchronized execute
    # calls); the host term is then fitted on whole engine steps (fedsim/calibrate/host.py).
    fits = fit_all(observations)
    engine_rows = engine_step_rows(args.results, args.grid, args.engine_run)
    fits = [
        replace(f, step=replace(f.step, host=fit_host(f.step, engine_rows[(f.card, f.model)])))
        if len(engine_rows.get((f.card, f.model), ())) >= 2
        else f
        for f in fits
    ]
    by_key = {(f.card, f.model): f for f in fits}
    replays: dict[str, Any] = {}
    fit_replay: dict[str, Any] = {}
    h200 = by_key.get(("h200", "llama1b"))
    if h200 is not None:
        runs = measured_runs(args.results, args.shared, args.engine_run)
        fit_run = FIT_RUN if args.engine_run is None else "engine_burst"
        step = h200.step
        if fit_run in runs:
            admitting = fit_admitting(runs[fit_run], step)
            step = replace(step, host=replace(step.host, admitting_step_s=admitting))
            fit_replay = {fit_run: compare(runs[fit_run], step).to_json()}
        fits = [replace(f, step=step) if f is h200 else f for f in fits]
        fits = [f if f is h200 else _with_admitting(f, step) for f in fits]
        for name, measured in runs.items():
            if name != fit_run:
                replays[name] = compare(measured, step).to_json()
    # The headline is the calibration run's (the grid's card), else every fit's worst.
    grid_cards = sorted({o.card for g in args.grid for o in grid_observations(g)})
    headline = [f for f in fits if f.card in grid_cards] if grid_cards else fits
    gpu = args.gpu or (grid_cards[0] if grid_cards else "existing")
    given = sys.argv[1:] if argv is None else argv
    command = "python -m fedsim.calibrate " + " ".join(str(a) for a in given)
    payload = {
        "command": command,
        "step_time_error_p50": max(f.error_p50 for f in headline),
        "fits": [f.to_json() for f in fits],
        "replay_error": {name: r["relative_error"] for name, r in replays.items()},
        "replays": replays,
        "fitted_on_run": fit_replay,
        "observations": len(observations),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"calibration_{gpu}.json").write_text(json.dumps(payload, indent=2) + "\n")
    text = _markdown(fits, replays | fit_replay, command, list(fit_replay))
    (args.out / f"calibration_{gpu}.md").write_text(text)
    models = {f"{f.card}/{f.model}": f.step.to_json() for f in fits}
    (args.out / "step_models.json").write_text(json.dumps(models, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
