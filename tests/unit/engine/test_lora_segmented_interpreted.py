"""The LoRA kernels (site_engine/engine/cuda/lora_segmented.py, the kernels before issue 69 and
the engine's one path) on the CPU through Triton's interpreter, against a float64 reference.

Fresh random data every run (the seed is in every failure); float32 only (the interpreter runs
on numpy). Skipped where triton is not installed (a dev dependency).
"""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.support.lora_weights import (
    check_nan_slot_isolated,
    check_stack_case,
    check_step_matches_pytorch_step,
    interpreted,
    stack_case,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def segmented() -> ModuleType:
    return interpreted("site_engine.engine.cuda.lora_segmented")


# tokens, in_f, widths, slots, max_rank: a decode step of one row; q/k/v-like widths, not whole
# column blocks; two splits of the shrink; a prefill-sized step (64-row tiles, 520 > 512 rows).
CASES = [
    (1, 256, (256,), 4, 16),
    (37, 384, (256, 128, 128), 8, 16),
    (64, 1024, (72, 40, 40), 6, 8),
    (520, 128, (64, 64), 3, 16),
]


@pytest.mark.parametrize(("tokens", "in_f", "widths", "slots", "max_rank"), CASES)
def test_the_kernels_match_the_float64_reference(
    segmented: ModuleType, tokens: int, in_f: int, widths: tuple[int, ...], slots: int,
    max_rank: int,
) -> None:  # fmt: skip
    case = stack_case(tokens, in_f, widths, slots, max_rank)
    got = case.wide.clone()
    segmented.SegmentedLauncher(case.token_slots, slots).run(case.x, case.a, case.b,
                                                             case.out(got), case.scaling,
                                                             widths)  # fmt: skip
    check_stack_case(case, got)


def test_a_nan_slot_reaches_no_other_row(segmented: ModuleType) -> None:
    check_nan_slot_isolated(segmented.SegmentedLauncher)


def test_the_step_matches_the_pytorch_step(segmented: ModuleType) -> None:
    check_step_matches_pytorch_step(segmented.SegmentedLauncher)
