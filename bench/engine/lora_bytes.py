"""The bytes the multi-LoRA kernels must move in one step (issue 69's floor), from the model's
shapes: what `lora_kernel_bandwidth_fraction` divides by the kernels' time.

Per stack of projections sharing an input (lora/slots.py's `Stack`: q/k/v, o, gate/up, down), per
layer, for `slots_used` adapters over `rows` rows with an adapter:

- shrink: every used slot's A ([in, n * R], ranks padded to the site's max rank R, as the slots
  store them) and the rows' inputs x ([rows, in]);
- expand: every used slot's B ([R, out]) and the rows' outputs, read and written ([rows, out]
  twice: the delta is added into the base GEMM's output).

The shrink's float32 partial sums are left out (a few MB a step that stay in L2), and so are the
tiles' index reads. At least these bytes cross between the SMs and memory, once each, whatever
the kernels do; their time at the card's measured copy rate is the floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.engine.lora_loading import base_shapes
from site_engine.engine.lora.adapter import BaseShapes
from site_engine.engine.lora.stacks import Stack, stacks_of


@dataclass(frozen=True, slots=True)
class StackBytes:
    """One layer's bytes of one stack."""

    name: str  # "+"-joined projections
    weights_a: int
    inputs: int
    weights_b: int
    outputs: int  # read and written

    @property
    def shrink(self) -> int:
        return self.weights_a + self.inputs

    @property
    def expand(self) -> int:
        return self.weights_b + self.outputs

    @property
    def total(self) -> int:
        return self.shrink + self.expand


def stack_bytes(stack: Stack, rank: int, slots_used: int, rows: int, element: int) -> StackBytes:
    width = len(stack.projections) * rank
    return StackBytes(
        name="+".join(stack.projections),
        weights_a=slots_used * stack.in_features * width * element,
        inputs=rows * stack.in_features * element,
        weights_b=slots_used * rank * stack.out_features * element,
        outputs=2 * rows * stack.out_features * element,
    )


def unique_stacks(base: BaseShapes) -> list[Stack]:
    """The model's stacks, each once, in forward order."""
    seen: list[Stack] = []
    for stack in stacks_of(base).values():
        if stack not in seen:
            seen.append(stack)
    return seen


def layer_bytes(
    base: BaseShapes, rank: int, slots_used: int, rows: int, element: int
) -> list[StackBytes]:
    """One layer's bytes, stack by stack."""
    return [stack_bytes(s, rank, slots_used, rows, element) for s in unique_stacks(base)]


def step_bytes(base: BaseShapes, rank: int, slots_used: int, rows: int, element: int) -> int:
    """All layers' bytes of one step: the LoRA kernels' floor."""
    per_layer = sum(s.total for s in layer_bytes(base, rank, slots_used, rows, element))
    return base.num_layers * per_layer


def shapes_of(shape: dict[str, Any], num_layers: int | None = None) -> BaseShapes:
    """A Llama-shaped model's projection shapes from its config dict (bench/engine/model_setup),
    with `num_layers` layers instead of its own if given."""
    base = base_shapes(shape)
    return base if num_layers is None else BaseShapes(num_layers, base.features)
