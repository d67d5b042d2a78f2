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
from fedsim.calibrate.replay import compare, fit_loop_scale, measured_runs

# The run the host term's loop_scale is fitted on (the newest engine's burst): FITTING ONLY,
# its errors are reported apart, never as replay_error.
FIT_RUN = "serving_burst"

REPO = Path(__file__).resolve().parent.parent.parent
RESULTS = REPO / "bench" / "results"
STEP_MODELS = RESULTS / "sim" / "step_models.json"


def _markdown(fits: Sequence[Fitted], replays: dict[str, Any], command: str) -> str:
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
            label = f"{name} (loop_scale fitted on it)" if name == FIT_RUN else name
            lines.append(f"| {label} | {key} | {measured:.4f} | {simulated:.4f} | {error:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedsim.calibrate")
    parser.add_argument("--grid", type=Path, nargs="*", default=[])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--shared", type=Path, default=REPO.parent / "shared")
    parser.add_argument("--out", type=Path, default=RESULTS / "sim")
    parser.add_argument("--gpu", default=None, help="the file's label (default: the grid's card)")
    args = parser.parse_args(argv)
    observations = existing_observations(args.results)
    for grid in args.grid:
        observations += grid_observations(grid)
    # The held-out error is the kernel model's (the grid's rows are synchronized execute
    # calls); the host term is then fitted on whole engine steps (fedsim/calibrate/host.py).
    fits = fit_all(observations)
    engine_rows = engine_step_rows(args.results, args.grid)
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
        runs = measured_runs(args.results, args.shared)
        step = h200.step
        if FIT_RUN in runs:
            scale = fit_loop_scale(runs[FIT_RUN], step)
            step = replace(step, host=replace(step.host, loop_scale=scale))
            fits = [replace(f, step=step) if f is h200 else f for f in fits]
            fit_replay = {FIT_RUN: compare(runs[FIT_RUN], step).to_json()}
        for name, measured in runs.items():
            if name != FIT_RUN:
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
    (args.out / f"calibration_{gpu}.md").write_text(_markdown(fits, replays | fit_replay, command))
    models = {f"{f.card}/{f.model}": f.step.to_json() for f in fits}
    (args.out / "step_models.json").write_text(json.dumps(models, indent=2) + "\n")
    print(_markdown(fits, replays | fit_replay, command))


if __name__ == "__main__":
    main()
