"""Issue 77's LoRA kernel path (site_engine/engine/cuda/lora_splitk.py) on the CPU, through
Triton's interpreter (devtools/triton_interpreter.py), against a float64 reference.

Fresh random data every run (the seed is in every failure): stacks of one to three projections
(q/k/v-like widths, whole column blocks and not), input widths that are whole shrink blocks and
not, slots of mixed ranks zero-padded to the site's max rank, rows of no adapter (-1: untouched,
bit for bit), decode-sized steps (tiles of 16 and 32 rows) and prefill-sized ones (64), slots
whose rows fill more than one tile, more tiles than programs (a program walks several) and
shrinks split several ways (the split that finishes last sums the planes), the deltas into a
column slice of a wider output, s and the partial sums' scratch poisoned with NaN. The
interpreter runs float32 only (numpy has no bfloat16) and no programmatic dependent launch; the
bfloat16, PDL and graph checks are tests/gpu/test_lora_kernels.py's.

Skipped where triton is not installed (it is a dev dependency: pyproject.toml's `dev` extra).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.lora.segmented_step import (
    LORA_KERNELS,
    check_lora_kernels,
)
from site_engine.engine.lora.slots import LoraSlots
from tests.support.lora_weights import (
    check_nan_slot_isolated,
    check_stack_case,
    check_step_matches_pytorch_step,
    fresh_seed,
    interpreted,
    random_stack,
    small_shapes,
    stack_case,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def splitk() -> ModuleType:
    return interpreted("site_engine.engine.cuda.lora_splitk")


def _apply(
    splitk: ModuleType, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    scaling: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor, widths: tuple[int, ...],
    slots: int, rows: int | None, programs: int | None,
) -> torch.Tensor:  # fmt: skip
    """y += the kernels' deltas, with s and the partial sums' scratch poisoned with NaN; the
    tile counters checked zero afterwards; s returned (NaN where no slot's row)."""
    seg = splitk.segments(token_slots, slots, rows)
    counts = torch.zeros(seg.tiles, dtype=torch.int32)
    grid = splitk.shrink_programs(seg.tile_rows, a.shape[2]) if programs is None else programs
    s = torch.full((x.shape[0], a.shape[2]), float("nan"))
    scratch = torch.full((grid, seg.tile_rows, a.shape[2]), float("nan"))
    splitk.lora_shrink(x, a, scaling, seg, counts, grid, s, scratch)
    splitk.lora_expand(s, b, y, seg, widths, programs)
    assert not bool(counts.any())  # each tile's last split set its counter back
    return s


# tokens, in_f, widths, slots, max_rank, tile rows (None: the step's own), programs (None: the
# module's grids), input features a split reads at least.
CASES = [
    (1, 256, (256,), 4, 16, None, None, 256),  # a decode step of one row
    (37, 384, (256, 128, 128), 8, 16, 16, 64, 64),  # q/k/v-like; 3 splits a tile
    (64, 320, (72, 40, 40), 6, 8, 32, 40, 64),  # no whole blocks, in nor out; rank 8
    (96, 512, (512, 512), 3, 16, 32, None, 64),  # ~24 rows a slot: one tile each
    (130, 256, (200,), 5, 32, 16, 3, 64),  # more tiles than programs; rank 32
    (300, 256, (128, 128), 2, 16, 16, 16, 64),  # a slot's rows over several tiles
    (520, 128, (64, 64), 3, 16, None, None, 64),  # prefill-sized: 64-row tiles
]


@pytest.mark.parametrize(
    ("tokens", "in_f", "widths", "slots", "max_rank", "rows", "programs", "features"), CASES
)
def test_kernels_match_the_float64_reference(
    splitk: ModuleType, monkeypatch: pytest.MonkeyPatch, tokens: int, in_f: int,
    widths: tuple[int, ...], slots: int, max_rank: int, rows: int | None, programs: int | None,
    features: int,
) -> None:  # fmt: skip
    monkeypatch.setattr(splitk, "_SPLIT_FEATURES", features)
    case = stack_case(tokens, in_f, widths, slots, max_rank)
    got = case.wide.clone()
    s = _apply(splitk, case.x, case.a, case.b, case.scaling, case.token_slots, case.out(got),
               widths, slots, rows, programs)  # fmt: skip
    check_stack_case(case, got)
    # Every adapter row's s written, no other.
    base_rows = case.token_slots < 0
    assert bool(s[~base_rows].isfinite().all()), case.seed
    assert bool(s[base_rows].isnan().all()), case.seed


def test_splits_and_reruns_agree(splitk: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun gives the same bits (the planes are summed in split order, whichever split
    finished last); other split counts give the same deltas within float32 rounding."""
    monkeypatch.setattr(splitk, "_SPLIT_FEATURES", 64)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    widths, slots = (128, 64, 64), 5
    a, b, scaling = random_stack(512, widths, slots, 16, gen)
    x = torch.randn(48, 512, generator=gen)
    token_slots = torch.randint(-1, slots, (48,), generator=gen)
    y = torch.randn(48, sum(widths), generator=gen)
    outs: dict[int, list[torch.Tensor]] = {}
    for programs in (1, 64, 64):  # one split a tile, then several (twice)
        got = y.clone()
        _apply(splitk, x, a, b, scaling, token_slots, got, widths, slots, 16, programs)
        outs.setdefault(programs, []).append(got)
    assert torch.equal(outs[64][0], outs[64][1]), seed
    torch.testing.assert_close(outs[1][0], outs[64][0], atol=1e-5, rtol=1e-5)


def test_a_step_of_base_rows_only_changes_nothing(splitk: ModuleType) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    a, b, scaling = random_stack(256, (64, 32), 3, 16, gen)
    x = torch.randn(20, 256, generator=gen)
    y = torch.randn(20, 96, generator=gen)
    got = y.clone()
    s = _apply(splitk, x, a, b, scaling, torch.full((20,), -1), got, (64, 32), 3, 16, None)
    assert torch.equal(got, y)
    assert bool(s.isnan().all())


def test_a_nan_slot_reaches_no_other_row(splitk: ModuleType) -> None:
    check_nan_slot_isolated(splitk.SplitKLauncher)


def test_bad_arguments_are_refused(splitk: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    a, b, scaling = random_stack(256, (64,), 2, 16, gen)
    x, y = torch.randn(8, 256), torch.randn(8, 64)
    seg = splitk.segments(torch.zeros(8, dtype=torch.long), 2, 16)
    counts = torch.zeros(seg.tiles, dtype=torch.int32)
    before = y.clone()
    with pytest.raises(ValueError, match="counts"):
        splitk.lora_shrink(x, a, scaling, seg, torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="scratch"):
        splitk.lora_shrink(x, a, scaling, seg, counts, 4, None, torch.empty(4, 16, 8))
    with pytest.raises(ValueError, match="unit stride"):
        splitk.lora_shrink(x.t().contiguous().t(), a, scaling, seg, counts)
    s = splitk.lora_shrink(x, a, scaling, seg, counts)
    with pytest.raises(ValueError, match="columns"):
        splitk.lora_expand(s, b, y, seg, (32, 32))
    with pytest.raises(ValueError, match="tile rows"):
        splitk.segments(torch.zeros(8, dtype=torch.long), 2, 24)
    assert torch.equal(y, before)


def test_the_step_matches_the_pytorch_step(splitk: ModuleType) -> None:
    check_step_matches_pytorch_step(splitk.SplitKLauncher)


def test_a_kernel_path_outside_the_choices_is_refused(tmp_path: Path) -> None:
    assert LORA_KERNELS == ("segmented", "splitk")
    assert LoraSettings(tmp_path).kernels == "segmented"  # until a GPU run says otherwise
    assert LoraSettings(tmp_path, kernels="splitk").kernels == "splitk"
    assert check_lora_kernels("splitk") == "splitk"
    with pytest.raises(ValueError, match="segmented, splitk; got 'one_launch'"):
        LoraSettings(tmp_path, kernels="one_launch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lora kernels"):
        LoraSlots(small_shapes(), 2, 8, torch.float32, torch.device("cpu"),
                  kernels="Segmented")  # type: ignore[arg-type]  # fmt: skip
