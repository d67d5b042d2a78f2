"""The fitted step-time models the simulator runs with (bench/results/sim/step_models.json,
written by `python -m fedsim.calibrate`), per card and model shape.

A (card, model) not fitted is derived: from the same model fitted on another card by the
roofline's ratios (StepTimeModel.on), else from another model shape on the same card by the
shapes' ratios: weights read and per-token matmul work scale with the parameter count, KV read
with KV bytes per token, attention with layers x heads x head size, launch costs with layers.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path

from fedsim.cards import CARDS
from fedsim.step_time import StepTimeModel

STEP_MODELS = (
    Path(__file__).resolve().parent.parent / "bench" / "results" / "sim" / "step_models.json"
)

# Llama-3.1-8B over Llama-3.2-1B: parameters, KV bytes per token, attention work per pair
# (layers x query heads x head size), layers.
_8B_OVER_1B = {"params": 8.03 / 1.236, "kv": 4.0, "attention": 4.0, "layers": 2.0}


@cache
def fitted(path: Path = STEP_MODELS) -> dict[tuple[str, str], StepTimeModel]:
    data = json.loads(path.read_text())
    out = {}
    for key, value in data.items():
        card, model = key.split("/")
        out[(card, model)] = StepTimeModel.from_json(value)
    return out


def _shape_scaled(m: StepTimeModel, to_8b: bool) -> StepTimeModel:
    r = _8B_OVER_1B if to_8b else {k: 1 / v for k, v in _8B_OVER_1B.items()}
    return replace(
        m,
        base_s=m.base_s * r["params"],
        prefill_base_s=m.prefill_base_s * r["layers"],
        per_prefill_token_s=m.per_prefill_token_s * r["params"],
        per_decode_row_s=m.per_decode_row_s * r["params"],
        per_kv_token_s=m.per_kv_token_s * r["kv"],
        per_attention_s=m.per_attention_s * r["attention"],
        adapter_base_s=m.adapter_base_s * r["layers"],
        per_adapter_s=m.per_adapter_s * r["layers"],
    )


def step_model(card: str, model: str, path: Path = STEP_MODELS) -> StepTimeModel:
    """The fitted model of (card, model), else one derived (the module docstring)."""
    models = fitted(path)
    if (card, model) in models:
        return models[(card, model)]
    for (fitted_card, fitted_model), m in sorted(models.items()):
        if fitted_model == model:
            return m.on(CARDS[fitted_card], CARDS[card])
    for (fitted_card, _), m in sorted(models.items()):
        shaped = _shape_scaled(m, to_8b=model == "llama8b")
        return shaped.on(CARDS[fitted_card], CARDS[card])
    raise ValueError(f"no fitted step model in {path}")
