"""Small random LoRA adapters over a two-layer model's projection shapes, and the float64
reference of a stack's deltas, for the kernel tests (tests/gpu/test_lora_kernels.py,
tests/unit/engine/test_lora_kernels_interpreted.py)."""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

from site_engine.engine.lora.adapter import PROJECTIONS, BaseShapes, LoraAdapter

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def small_shapes() -> BaseShapes:
    """Two layers; q/k/v of unequal widths, an MLP wider than the hidden size."""
    features = {
        "q_proj": (128, 128), "k_proj": (128, 64), "v_proj": (128, 64), "o_proj": (128, 128),
        "gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128),
    }  # fmt: skip
    return BaseShapes(2, features)


def random_adapter(
    name: str, base: BaseShapes, rank: int, targets: tuple[str, ...], seed: int
) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(base.num_layers):
        for proj in targets:
            in_f, out_f = base.features[proj]
            a = torch.randn(in_f, rank, generator=generator) * 0.1
            b = torch.randn(rank, out_f, generator=generator) * 0.1
            weights[(layer, proj)] = (a, b)
    return LoraAdapter(name, rank, 16 / rank, weights)


def mixed_adapters(base: BaseShapes) -> list[LoraAdapter]:
    """Four adapters of ranks 4-16 over different projections (one on all seven)."""
    return [
        random_adapter("all-r16", base, 16, PROJECTIONS, seed=1),
        random_adapter("attn-r4", base, 4, ATTENTION, seed=2),
        random_adapter("mlp-r12", base, 12, MLP, seed=3),
        random_adapter("qv-r8", base, 8, ("q_proj", "v_proj"), seed=4),
    ]


def reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
    token_slots: torch.Tensor, y: torch.Tensor, widths: tuple[int, ...],
) -> torch.Tensor:  # fmt: skip
    """y + each row's deltas through a stack laid out as LoraSlots does (A [slots, in, n * R],
    B [slots, R, sum(widths)]), row by row and projection by projection, in float64."""
    out = y.double().clone()
    rank = b.shape[1]
    for row, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        first = 0
        for j, width in enumerate(widths):
            shrunk = x[row].double() @ a[slot, :, j * rank : (j + 1) * rank].double()
            delta = (shrunk * float(scaling[slot])) @ b[slot, :, first : first + width].double()
            out[row, first : first + width] += delta
            first += width
    return out


def fresh_seed() -> int:
    """A seed of its own for each run (the tests print it in every failure)."""
    return random.SystemRandom().randrange(2**31)


def random_stack(
    in_f: int, widths: tuple[int, ...], slots: int, max_rank: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [slots, in, n * R] and B [slots, R, sum(widths)] as LoraSlots lays a stack out, each
    slot of a random rank up to R (zero past it), and each slot's scaling."""
    parts = len(widths)
    a = torch.randn(slots, in_f, parts * max_rank, generator=gen) * 0.05
    b = torch.randn(slots, max_rank, sum(widths), generator=gen) * 0.05
    for slot in range(slots):
        rank = int(torch.randint(1, max_rank + 1, (1,), generator=gen))
        a.view(slots, in_f, parts, max_rank)[slot, :, :, rank:] = 0
        b[slot, rank:] = 0
    return a, b, 0.5 + torch.rand(slots, generator=gen) * 1.5


def interpreted_one_launch() -> ModuleType:
    """The one-launch kernels (cuda/lora_kernels.py) run by Triton's interpreter on the CPU;
    the test skips where triton is not installed (a dev dependency)."""
    pytest.importorskip("triton")
    from devtools.triton_interpreter import interpreted_module

    return interpreted_module(
        "site_engine.engine.cuda.lora_kernels", kernels=("site_engine.engine.cuda.lora_triton",)
    )
