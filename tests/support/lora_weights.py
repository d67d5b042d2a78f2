"""Small random LoRA adapters over a two-layer model's projection shapes, and the float64
reference of a stack's deltas, for the kernel tests (tests/gpu/test_lora_kernels.py,
tests/unit/engine/test_lora_segmented_interpreted.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from site_engine.engine.lora.adapter import PROJECTIONS, BaseShapes, LoraAdapter
from site_engine.engine.lora.segmented_step import SegmentedLoraStep, StackLauncher
from site_engine.engine.lora.slots import LoraSlots, SegmentedTorchStep
from site_engine.engine.lora.stacks import GATE_UP, QKV

# The kernels' launcher for a step: (token slots, number of slots) -> its launches.
Launcher = Callable[[torch.Tensor, int], StackLauncher]

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
    name: str, base: BaseShapes, rank: int, targets: tuple[str, ...], seed: int, max_rank: int = 16
) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(base.num_layers):
        for proj in targets:
            in_f, out_f = base.features[proj]
            a = torch.randn(in_f, rank, generator=generator) * 0.1
            b = torch.randn(rank, out_f, generator=generator) * 0.1
            weights[(layer, proj)] = (a, b)
    return LoraAdapter.from_pairs(name, rank, 16 / rank, weights, base, max_rank)


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


def interpreted(name: str) -> ModuleType:
    """Kernel module `name` (cuda/lora_segmented.py) run by Triton's interpreter on the CPU;
    the test skips where triton is not installed (a dev dependency)."""
    pytest.importorskip("triton")
    from devtools.triton_interpreter import interpreted_module

    return interpreted_module(name)


def check_nan_slot_isolated(launcher: Launcher) -> None:
    """A slot of NaN weights: its own rows come out NaN, every other row is its reference."""
    gen = torch.Generator().manual_seed(fresh_seed())
    widths = (64, 32, 32)
    a, b, scaling = random_stack(256, widths, 4, 16, gen)
    a[2] = float("nan")
    b[2] = float("nan")
    token_slots = torch.tensor([2, 0, -1, 2, 1, -1, 3, 0] * 4)
    x = torch.randn(32, 256, generator=gen)
    y = torch.randn(32, sum(widths), generator=gen)
    expected = reference(x, a, b, scaling, token_slots, y, widths)
    got = y.clone()
    launcher(token_slots, 4).run(x, a, b, got, scaling, widths)
    poisoned = token_slots == 2
    assert bool(got[poisoned].isnan().all())
    assert not bool(got[~poisoned].isnan().any())
    torch.testing.assert_close(got[~poisoned].double(), expected[~poisoned], atol=1e-4,
                               rtol=1e-4)  # fmt: skip


def check_step_matches_pytorch_step(launcher: Launcher) -> None:
    """SegmentedLoraStep over LoraSlots with the kernels' launcher (every stack at once, and each
    projection alone into its columns) against lora/slots.py's SegmentedTorchStep, float32."""
    base = small_shapes()
    slots = LoraSlots(base, num_slots=6, max_rank=16, dtype=torch.float32,
                      device=torch.device("cpu"))  # fmt: skip
    by_name = {adapter.name: adapter for adapter in mixed_adapters(base)}
    assigned = slots.assign(by_name, by_name.__getitem__)
    rng = random.Random(fresh_seed())
    token_slots = torch.tensor(
        [-1 if not n else assigned[n] for n in rng.choices(["", *by_name], k=40)]
    )
    step = SegmentedLoraStep(slots, launcher(token_slots, 6))
    want_step = SegmentedTorchStep(slots, token_slots)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    for layer in range(base.num_layers):
        for projections in (QKV, ("o_proj",), GATE_UP, ("down_proj",)):
            in_f = base.features[projections[0]][0]
            out_f = sum(base.features[p][1] for p in projections)
            x = torch.randn(40, in_f, generator=generator)
            y = torch.randn(40, out_f, generator=generator)
            want, got, each = y.clone(), y.clone(), y.clone()
            want_step.add_stack(layer, projections, x, want)
            assert not torch.equal(want, y), (layer, projections)
            step.add_stack(layer, projections, x, got)
            first = 0
            for proj in projections:
                width = base.features[proj][1]
                step.add(layer, proj, x, each[:, first : first + width])
                first += width
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(each, want, atol=1e-4, rtol=1e-4)


@dataclass(frozen=True)
class StackCase:
    """Random inputs of one stack's launch and their float64 reference: the deltas go into
    columns FIRST.. of a wider output `wide` (a fused GEMM's slice), a quarter of the rows of
    no adapter."""

    seed: int
    x: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scaling: torch.Tensor
    token_slots: torch.Tensor
    widths: tuple[int, ...]
    wide: torch.Tensor
    expected: torch.Tensor  # the slice's reference, float64

    FIRST = 16

    def out(self, wide: torch.Tensor) -> torch.Tensor:
        """The columns of `wide` (a copy of self.wide) the deltas go into."""
        return wide[:, self.FIRST : self.FIRST + sum(self.widths)]


def stack_case(
    tokens: int, in_f: int, widths: tuple[int, ...], slots: int, max_rank: int
) -> StackCase:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    a, b, scaling = random_stack(in_f, widths, slots, max_rank, gen)
    x = torch.randn(tokens, in_f, generator=gen)
    token_slots = torch.randint(0, slots, (tokens,), generator=gen)
    token_slots[torch.rand(tokens, generator=gen) < 0.25] = -1
    wide = torch.randn(tokens, sum(widths) + 48, generator=gen)
    first, end = StackCase.FIRST, StackCase.FIRST + sum(widths)
    expected = reference(x, a, b, scaling, token_slots, wide[:, first:end], widths)
    return StackCase(seed, x, a, b, scaling, token_slots, widths, wide, expected)


def check_stack_case(case: StackCase, got: torch.Tensor) -> None:
    """`got` (the wide output after the kernels) is the reference in the slice, within float32
    rounding; rows of no adapter and the columns beside the slice untouched, bit for bit; every
    adapter row moved by at least half its delta (a kernel that dropped deltas fails)."""
    seed, wide = case.seed, case.wide
    torch.testing.assert_close(case.out(got).double(), case.expected, atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"seed {seed}: {m}")  # fmt: skip
    base_rows = case.token_slots < 0
    end = case.FIRST + sum(case.widths)
    assert torch.equal(got[base_rows], wide[base_rows]), seed
    assert torch.equal(got[:, : case.FIRST], wide[:, : case.FIRST]), seed
    assert torch.equal(got[:, end:], wide[:, end:]), seed
    moved = (case.out(got) - case.out(wide))[~base_rows].abs().amax(1)
    want = (case.expected - case.out(wide).double())[~base_rows].abs().amax(1)
    assert bool((moved.double() > 0.5 * want).all()), seed
