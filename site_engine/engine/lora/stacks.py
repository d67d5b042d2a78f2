"""Projections that read the same input, stacked: one shrink and one expand serve them all (as
Punica's SGMV and vLLM's lora_shrink/lora_expand do for their "slices"). A stack's adapter
weights are laid out the same way in a device slot (lora/slots.py) and in host memory
(lora/host_layout.py), so that writing an adapter into a slot is one copy a stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from site_engine.engine.lora.adapter_shapes import PROJECTIONS, BaseShapes

# Projections that read the same input, in the order of the fused models' outputs.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
_GROUPS = (QKV, ("o_proj",), GATE_UP, ("down_proj",))


@dataclass(frozen=True, slots=True)
class Stack:
    """Projections sharing an input, their outputs side by side (a fused GEMM's columns)."""

    projections: tuple[str, ...]
    in_features: int
    widths: tuple[int, ...]  # each projection's output features

    @property
    def out_features(self) -> int:
        return sum(self.widths)

    def columns(self, proj: str) -> tuple[int, int]:
        """(first, end) of `proj`'s output columns."""
        index = self.projections.index(proj)
        first = sum(self.widths[:index])
        return first, first + self.widths[index]


def stacks_of(base: BaseShapes) -> dict[str, Stack]:
    """Each projection's stack: the fused models' groups where their inputs agree."""
    stacks: dict[str, Stack] = {}
    for group in _GROUPS:
        inputs = {base.features[proj][0] for proj in group}
        parts = [group] if len(inputs) == 1 else [(proj,) for proj in group]
        for part in parts:
            stack = Stack(part, base.features[part[0]][0], tuple(base.features[p][1] for p in part))
            stacks.update(dict.fromkeys(part, stack))
    assert set(stacks) == set(PROJECTIONS)
    return stacks
