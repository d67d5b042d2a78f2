"""Fitting the step-time model (fedsim/step_time.py) on measured steps.

Sources, all measured by the real engine (ModelRunner.execute or whole engine steps):
- the step grid (bench/engine/step_grid.py: step_grid_<gpu>.json), the calibration run;
- before it, what bench/results already holds: the step shapes
  (engine_serving_h200.json, engine_prefill/engine_step_shapes_h100_seqs1024.json: mixed,
  prefill-only and decode-only steps; their chunk split is approximated from the row: equal
  fresh chunks, the continuing one after 300 cached positions, as bench/engine/step_shapes.py
  builds them).

The fit minimises relative error (each row weighted by 1 / its time) with every coefficient
>= 0 (a term that would come out negative is dropped and the rest refitted), so a model fitted
on 1 ms decode steps and 60 ms prefill steps is good on both.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.federation import percentile
from fedsim.step_time import COEFFICIENTS, StepFeatures, StepTimeModel, design_row, model_from


@dataclass(frozen=True, slots=True)
class Observation:
    card: str
    model: str
    features: StepFeatures
    seconds: float
    source: str


def grid_observations(path: Path) -> list[Observation]:
    """The rows of a step_grid_<gpu>.json (skipped rows left out)."""
    data = json.loads(path.read_text())
    out = []
    for model in data["models"]:
        for row in model["steps"]:
            if "ms" not in row:
                continue
            features = StepFeatures(
                row["prefill_tokens"],
                row["decode_rows"],
                row["kv_read_tokens"],
                row.get("prefill_attention", 0),
                row["adapters"],
            )
            out.append(
                Observation(
                    model["device"],
                    model["model"],
                    features,
                    row["ms"] / 1e3,
                    f"{path.name}:{row['shape']}",
                )
            )
    return out


def _shape_rows(rows: Iterable[dict[str, Any]], card: str, source: str) -> list[Observation]:
    """Step-shape rows: the mixed step and its two parts."""
    out = []
    for r in rows:
        chunks, continuing = r["prefill_chunks"], r["continuing_chunks"]
        per_chunk = r["prefill_tokens"] / max(chunks, 1)
        cached = 300 * continuing
        attention = round(chunks * per_chunk * per_chunk + cached * per_chunk)
        prefill_kv = r["prefill_tokens"] + cached
        decode_kv = r["decode_rows"] * r["decode_context"]
        parts = {
            "mixed_ms": StepFeatures(
                r["prefill_tokens"], r["decode_rows"], prefill_kv + decode_kv, attention, 0
            ),
            "prefill_only_ms": StepFeatures(r["prefill_tokens"], 0, prefill_kv, attention, 0),
            "decode_only_ms": StepFeatures(0, r["decode_rows"], decode_kv, 0, 0),
        }
        for key, features in parts.items():
            out.append(
                Observation(card, "llama1b", features, r[key] / 1e3, f"{source}:{r['shape']}:{key}")
            )
    return out


def existing_observations(results: Path) -> list[Observation]:
    """The measured steps bench/results holds today (the module docstring)."""
    out: list[Observation] = []
    # The decode sweeps are engine-step periods with async scheduling on, not synchronized
    # execute calls: they set the host term (host.py), never the kernel model.
    serving = results / "engine_serving" / "engine_serving_h200.json"
    if serving.is_file():
        data = json.loads(serving.read_text())
        out += _shape_rows(data.get("step_shapes") or [], "h200", serving.name)
    shapes = results / "engine_prefill" / "engine_step_shapes_h100_seqs1024.json"
    if shapes.is_file():
        calls = json.loads(shapes.read_text())["calls"]
        for call in calls.values():
            for run in call.values():
                for label, arm in run.items():
                    if label == "after" and isinstance(arm, dict) and "rows" in arm:
                        out += _shape_rows(arm["rows"], "h100", shapes.name)
    return out


def held_out(observation: Observation, share: int = 4) -> bool:
    """Every `share`-th row by a stable hash of its source: the rows the fit never sees."""
    digest = hashlib.sha256(observation.source.encode()).digest()
    return digest[0] % share == 0


def fit(observations: Sequence[Observation], card: str) -> StepTimeModel:
    """Least relative squares with non-negative coefficients (the module docstring)."""
    if not observations:
        raise ValueError(f"no observations to fit for {card}")
    x = np.array([design_row(o.features) for o in observations], dtype=float)
    y = np.array([o.seconds for o in observations], dtype=float)
    w = 1.0 / y
    active = [i for i in range(len(COEFFICIENTS)) if np.any(x[:, i] != 0)]
    while True:
        a = x[:, active] * w[:, None]
        solution, *_ = np.linalg.lstsq(a, y * w, rcond=None)
        if all(v >= 0 for v in solution) or len(active) == 1:
            break
        active = [i for i, v in zip(active, solution, strict=True) if v >= 0]
    values = [0.0] * len(COEFFICIENTS)
    for i, v in zip(active, solution, strict=True):
        values[i] = max(float(v), 0.0)
    return model_from(card, values)


def relative_errors(model: StepTimeModel, observations: Iterable[Observation]) -> list[float]:
    return [abs(model.seconds(o.features) - o.seconds) / o.seconds for o in observations]


@dataclass(frozen=True, slots=True)
class Fitted:
    card: str
    model: str
    step: StepTimeModel
    train_rows: int
    held_out_rows: int
    error_p50: float
    error_p90: float
    error_max: float

    def to_json(self) -> dict[str, Any]:
        return {
            "card": self.card,
            "model": self.model,
            "coefficients": self.step.to_json(),
            "train_rows": self.train_rows,
            "held_out_rows": self.held_out_rows,
            "step_time_error_p50": self.error_p50,
            "step_time_error_p90": self.error_p90,
            "step_time_error_max": self.error_max,
        }


def fit_all(observations: Sequence[Observation]) -> list[Fitted]:
    """One model per (card, model shape) the observations cover: fitted on the rows not held
    out, its relative error on those held out (on every row when too few to hold any out)."""
    out = []
    for card, model in sorted({(o.card, o.model) for o in observations}):
        rows = [o for o in observations if o.card == card and o.model == model]
        # The calibration grid, where it covers the pair, alone: the older profiles were taken
        # by other engine versions and other harnesses.
        gridded = [o for o in rows if o.source.startswith("step_grid")]
        rows = gridded or rows
        train = [o for o in rows if not held_out(o)]
        test = [o for o in rows if held_out(o)]
        if len(train) < 4 or not test:
            train, test = rows, rows
        step = fit(train, card)
        errors = relative_errors(step, test)
        out.append(
            Fitted(
                card,
                model,
                step,
                len(train),
                len(test),
                statistics.median(errors),
                percentile(errors, 0.9),
                max(errors),
            )
        )
    return out
