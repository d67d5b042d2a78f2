"""Narrowing the predictor's encoder layers (predictor.minilm.narrow_layer): the units that
weigh least go, what is left computes what it computed, and the widths travel with artifacts."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from predictor.finetune import FinetuneConfig, base_finetune_config
from predictor.minilm import LengthClassifier, build_classifier, narrow_layer


def _layers(model: LengthClassifier) -> list[Any]:
    return list(cast(Any, model.encoder).encoder.layer)


def _layer_output(model: LengthClassifier, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    hidden: torch.Tensor = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    return hidden


@pytest.mark.parametrize(
    ("ffn_width", "heads"),
    [(1024, None), (None, 8), (1024, 8), (1536, 12)],  # the last keeps every unit
)
def test_units_that_contribute_nothing_are_the_ones_dropped(ffn_width, heads) -> None:
    """Silence the units beyond the widths kept (their written weights zeroed): they then weigh
    nothing, narrowing drops exactly them, and the layer's output does not move."""
    model = build_classifier(10, layers=1).eval()
    layer = _layers(model)[0]
    size = layer.attention.self.attention_head_size
    with torch.no_grad():
        # Silence units spread over the layer, not the last ones: the order must be kept.
        if ffn_width is not None:
            layer.output.dense.weight[:, 1::3][:, : 1536 - ffn_width] = 0.0
        if heads is not None:
            for head in range(1, 1 + 2 * (12 - heads), 2):
                layer.attention.output.dense.weight[:, head * size : (head + 1) * size] = 0.0
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 1012, 102]])
    before = _layer_output(model, ids)
    narrow_layer(layer, ffn_width, heads)
    after = _layer_output(model, ids)
    assert layer.intermediate.dense.out_features == (ffn_width or 1536)
    assert layer.output.dense.in_features == (ffn_width or 1536)
    assert layer.attention.self.query.out_features == (heads or 12) * size
    assert layer.attention.output.dense.in_features == (heads or 12) * size
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("ffn_width", "heads"), [(0, None), (1537, None), (None, 0), (None, 13)])
def test_widths_beyond_the_layer_are_refused(ffn_width, heads) -> None:
    layer = _layers(build_classifier(10, layers=1))[0]
    with pytest.raises(ValueError, match="must be within"):
        narrow_layer(layer, ffn_width, heads)


def test_build_classifier_narrows_every_kept_layer() -> None:
    model = build_classifier(10, layers=2, ffn_width=512, heads=6)
    for layer in _layers(model):
        assert layer.intermediate.dense.weight.shape == (512, 384)
        assert layer.attention.self.key.weight.shape == (6 * 32, 384)


def test_widths_are_recorded_only_when_narrowed_and_read_back_for_a_warm_start() -> None:
    assert {"ffn_width", "heads"}.isdisjoint(FinetuneConfig().to_json())
    narrowed = FinetuneConfig(ffn_width=768, heads=8)
    model = narrowed.to_json()
    assert (model["ffn_width"], model["heads"]) == (768, 8)

    # base_finetune_config reads only the manifest's training record.
    manifest = SimpleNamespace(training={"config": {"model": model}})
    base = base_finetune_config(manifest)  # type: ignore[arg-type]
    assert (base.ffn_width, base.heads, base.layers) == (768, 8, narrowed.layers)
