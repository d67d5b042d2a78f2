"""What an adapter must fit: the served base model's layer count and projection shapes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

# The Llama-family projections an adapter may target, in the order the engine applies them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MLP = frozenset({"gate_proj", "up_proj", "down_proj"})


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """What an adapter must fit: the layer count and each projection's (in, out) features."""

    num_layers: int
    features: Mapping[str, tuple[int, int]]

    @classmethod
    def of_model(cls, model: nn.Module) -> BaseShapes:
        """The shapes of a loaded Llama-family transformers model (every layer alike)."""
        layers = model.get_submodule("model.layers")
        assert isinstance(layers, nn.ModuleList)
        first = layers[0]
        features: dict[str, tuple[int, int]] = {}
        for proj in PROJECTIONS:
            parent = "mlp" if proj in _MLP else "self_attn"
            weight = first.get_submodule(f"{parent}.{proj}").get_parameter("weight")
            features[proj] = (int(weight.shape[1]), int(weight.shape[0]))
        return cls(len(layers), features)
