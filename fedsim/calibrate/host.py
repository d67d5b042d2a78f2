"""The engine loop's host term (fedsim/step_time.py's HostOverhead), fitted on whole
`engine.step()` periods.

The grid times `ModelRunner.execute` synchronized: device time plus the runner's host work. A
real engine with async scheduling overlaps the host work of step N+1 with the device's step N,
so a filled engine's measured period is shorter than the grid's time for the same step: on an
H200, 256 decode rows at ~550 positions take 5.3 ms in the grid and in an engine with async
scheduling off, 3.3 ms with it on (engine_h200.json's decode_sweep). h = grid - period is the
host time the overlap hides; it is fitted as constant + per row by least squares.

Rows used, per (card, model), the first source that has them:
1. the decode sweep of the engine run whose workloads replay.py replays (REPLAYED_SWEEP): the
   period is the engine configuration's, and the simulated site replays that configuration. The
   grid's own `engine_steps`, taken two minutes before that run on the same build and card, ran
   256 rows in 5.3 ms against the run's 3.2 ms (and 8.2 against 6.0 ms with async scheduling
   off), by the same decode_sweep function; why is not yet known;
2. a grid's `engine_steps` (bench/engine/step_grid.py --engine-steps);
3. the older decode sweeps bench/results holds for the H200 1B (EXISTING_SWEEPS).
The sweep is a phase apart from the workloads replayed (B decode rows at ~550 positions, no
arrivals, no prefill), so the replays validate the term.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.step_time import HostOverhead, StepFeatures, StepTimeModel

REPLAYED_SWEEP = ("h200", "llama1b", Path("engine") / "engine_h200_20261127.json")
EXISTING_SWEEPS = (
    ("h200", "llama1b", Path("engine") / "engine_h200.json"),
    ("h200", "llama1b", Path("engine_serving") / "engine_serving_h200.json"),
)


def _sweep(rows: Iterable[dict[str, Any]]) -> list[tuple[StepFeatures, float]]:
    """(features, measured period s) of decode_sweep-shaped rows (async scheduling on)."""
    return [
        (
            StepFeatures(0, r["batch_size"], round(r["batch_size"] * r["mean_context_len"]), 0, 0),
            r["decode_step_ms"] / 1e3,
        )
        for r in rows
        if "decode_step_ms" in r
    ]


def engine_step_rows(
    results: Path, grids: Sequence[Path], engine_run: Path | None = None
) -> dict[tuple[str, str], list[tuple[StepFeatures, float]]]:
    """Whole engine-step periods per (card, model), the first source that has them (the module
    docstring); `engine_run`: the replayed engine run's file, when not REPLAYED_SWEEP's."""
    out: dict[tuple[str, str], list[tuple[StepFeatures, float]]] = {}
    card, model, relative = REPLAYED_SWEEP
    replayed_file = engine_run or results / relative
    if replayed_file.is_file():
        rows = _sweep(json.loads(replayed_file.read_text()).get("decode_sweep") or [])
        if rows:
            out[(card, model)] = rows
    replayed = set(out)
    for grid in grids:
        for entry in json.loads(grid.read_text())["models"]:
            key = (entry["device"], entry["model"])
            rows = _sweep(entry.get("engine_steps") or [])
            if rows and key not in replayed:
                out.setdefault(key, []).extend(rows)
    measured = set(out)
    for card, model, relative in EXISTING_SWEEPS:
        path = results / relative
        if (card, model) in measured or not path.is_file():
            continue
        rows = _sweep(json.loads(path.read_text()).get("decode_sweep") or [])
        out.setdefault((card, model), []).extend(rows)
    return out


def fit_host(step: StepTimeModel, rows: Sequence[tuple[StepFeatures, float]]) -> HostOverhead:
    """h = the kernel model's time - the measured period, as constant + per row (>= 0 each)."""
    if len(rows) < 2:
        raise ValueError(f"a host term needs two engine-step rows or more, got {len(rows)}")
    kernel = replace(step, host=HostOverhead())
    x = np.array([[1.0, float(f.rows)] for f, _ in rows])
    hidden = np.array([kernel.seconds(f) - seconds for f, seconds in rows])
    (base, per_row), *_ = np.linalg.lstsq(x, hidden, rcond=None)
    return HostOverhead(max(float(base), 0.0), max(float(per_row), 0.0))
