"""The default LoRA kernel path (site_engine/engine/cuda/lora_segmented.py, the kernels before
issue 69) on the CPU through Triton's interpreter, against a float64 reference, and against the
one-launch path (cuda/lora_kernels.py) on the same inputs: the engine setting
LoraSettings.kernels picks one, and either must give the same deltas.

Fresh random data every run (the seed is in every failure); float32 only (the interpreter runs
on numpy). Skipped where triton is not installed (a dev dependency).
"""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType

import pytest
import torch

from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.lora.segmented_step import (
    LORA_KERNELS,
    SegmentedLoraStep,
    check_lora_kernels,
)
from site_engine.engine.lora.slots import GATE_UP, QKV, LoraSlots, SegmentedTorchStep
from tests.support.lora_weights import (
    fresh_seed,
    interpreted_one_launch,
    mixed_adapters,
    random_stack,
    reference,
    small_shapes,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def segmented() -> ModuleType:
    pytest.importorskip("triton")
    from devtools.triton_interpreter import interpreted_module

    return interpreted_module("site_engine.engine.cuda.lora_segmented")


@pytest.fixture(scope="module")
def one_launch() -> ModuleType:
    return interpreted_one_launch()


# tokens, in_f, widths, slots, max_rank: a decode step of one row; q/k/v-like widths, not whole
# column blocks; two splits of the shrink; a prefill-sized step (64-row tiles, 520 > 512 rows).
CASES = [
    (1, 256, (256,), 4, 16),
    (37, 384, (256, 128, 128), 8, 16),
    (64, 1024, (72, 40, 40), 6, 8),
    (520, 128, (64, 64), 3, 16),
]


@pytest.mark.parametrize(("tokens", "in_f", "widths", "slots", "max_rank"), CASES)
def test_both_paths_match_the_float64_reference_and_each_other(
    segmented: ModuleType, one_launch: ModuleType, tokens: int, in_f: int,
    widths: tuple[int, ...], slots: int, max_rank: int,
) -> None:  # fmt: skip
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    a, b, scaling = random_stack(in_f, widths, slots, max_rank, gen)
    x = torch.randn(tokens, in_f, generator=gen)
    token_slots = torch.randint(0, slots, (tokens,), generator=gen)
    token_slots[torch.rand(tokens, generator=gen) < 0.25] = -1
    out_f = sum(widths)
    wide = torch.randn(tokens, out_f + 48, generator=gen)  # the deltas go into columns 16..
    expected = reference(x, a, b, scaling, token_slots, wide[:, 16 : 16 + out_f], widths)
    outs = {}
    for name, launcher in (
        ("segmented", segmented.SegmentedLauncher(token_slots, slots)),
        ("one_launch", one_launch.OneLaunchLauncher(token_slots, slots, 1)),
    ):
        got = wide.clone()
        launcher.run(x, a, b, got[:, 16 : 16 + out_f], scaling, widths)
        torch.testing.assert_close(got[:, 16 : 16 + out_f].double(), expected, atol=1e-4,
                                   rtol=1e-4, msg=f"{name}, seed {seed}")  # fmt: skip
        base_rows = token_slots < 0
        assert torch.equal(got[base_rows], wide[base_rows]), (name, seed)
        assert torch.equal(got[:, :16], wide[:, :16]), (name, seed)
        assert torch.equal(got[:, 16 + out_f :], wide[:, 16 + out_f :]), (name, seed)
        outs[name] = got
    # The same deltas whichever path the setting picks (float32 sums in other orders).
    torch.testing.assert_close(outs["segmented"], outs["one_launch"], atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"seed {seed}: {m}")  # fmt: skip
    moved = (outs["segmented"] - wide)[token_slots >= 0].abs().amax(1)
    assert bool((moved > 0).all()), seed  # no adapter row left without its delta


def test_a_nan_slot_reaches_no_other_row(segmented: ModuleType) -> None:
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
    segmented.SegmentedLauncher(token_slots, 4).run(x, a, b, got, scaling, widths)
    poisoned = token_slots == 2
    assert bool(got[poisoned].isnan().all())
    assert not bool(got[~poisoned].isnan().any())
    torch.testing.assert_close(got[~poisoned].double(), expected[~poisoned], atol=1e-4,
                               rtol=1e-4)  # fmt: skip


def test_the_steps_of_both_paths_match_the_pytorch_step(
    segmented: ModuleType, one_launch: ModuleType
) -> None:
    """SegmentedLoraStep over LoraSlots with either path's launcher (every stack at once, and
    each projection alone into its columns) against lora/slots.py's SegmentedTorchStep."""
    base = small_shapes()
    slots = LoraSlots(base, num_slots=6, max_rank=16, dtype=torch.float32,
                      device=torch.device("cpu"))  # fmt: skip
    by_name = {adapter.name: adapter for adapter in mixed_adapters(base)}
    assigned = slots.assign(by_name, by_name.__getitem__)
    rng = random.Random(fresh_seed())
    token_slots = torch.tensor(
        [-1 if not n else assigned[n] for n in rng.choices(["", *by_name], k=40)]
    )
    steps = {
        "segmented": SegmentedLoraStep(slots, segmented.SegmentedLauncher(token_slots, 6)),
        "one_launch": SegmentedLoraStep(slots, one_launch.OneLaunchLauncher(token_slots, 6, 8)),
    }
    want_step = SegmentedTorchStep(slots, token_slots)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    for layer in range(base.num_layers):
        for projections in (QKV, ("o_proj",), GATE_UP, ("down_proj",)):
            in_f = base.features[projections[0]][0]
            out_f = sum(base.features[p][1] for p in projections)
            x = torch.randn(40, in_f, generator=generator)
            y = torch.randn(40, out_f, generator=generator)
            want = y.clone()
            want_step.add_stack(layer, projections, x, want)
            assert not torch.equal(want, y), (layer, projections)
            for name, step in steps.items():
                got, each = y.clone(), y.clone()
                step.add_stack(layer, projections, x, got)
                first = 0
                for proj in projections:
                    width = base.features[proj][1]
                    step.add(layer, proj, x, each[:, first : first + width])
                    first += width
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=name)
                torch.testing.assert_close(each, want, atol=1e-4, rtol=1e-4, msg=name)


def test_a_kernel_path_outside_the_choices_is_refused(tmp_path: Path) -> None:
    assert LORA_KERNELS == ("segmented", "one_launch")
    assert LoraSettings(tmp_path).kernels == "segmented"  # the faster path is the default
    assert LoraSettings(tmp_path, kernels="one_launch").kernels == "one_launch"
    assert check_lora_kernels("one_launch") == "one_launch"
    with pytest.raises(ValueError, match="segmented, one_launch; got 'stacked'"):
        LoraSettings(tmp_path, kernels="stacked")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lora kernels"):
        LoraSlots(small_shapes(), 2, 8, torch.float32, torch.device("cpu"),
                  kernels="Segmented")  # type: ignore[arg-type]  # fmt: skip
