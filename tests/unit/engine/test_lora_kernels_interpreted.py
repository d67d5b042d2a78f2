"""The segmented LoRA kernels (site_engine/engine/cuda/lora_kernels.py) on the CPU, through
Triton's interpreter (devtools/triton_interpreter.py), against a float64 reference.

Fresh random data every run (the seed is in every failure): stacks of one to three projections
(q/k/v-like widths, whole column blocks and not), slots of mixed ranks zero-padded to the site's
max rank, rows of no adapter (-1: untouched, bit for bit), decode-sized steps (16-row chunks) and
prefill-sized ones (64-row chunks), slots whose rows fill more than one tile, the deltas into a
column slice of a wider output, the shrink's partial sums and the output poisoned with NaN where
nothing may be read. Both the one-launch path (`lora_delta`: shrink and expand tasks in one grid,
ordered by an atomic ticket) and the two-launch path (`lora_shrink` + `lora_expand`), which
must agree bit for bit. The interpreter runs float32 only (numpy has no bfloat16); the bfloat16
and timing checks are tests/gpu/test_lora_kernels.py's.

Skipped where triton is not installed (it is a dev dependency: pyproject.toml's `dev` extra).
"""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

from site_engine.engine.lora.segmented_step import SegmentedLoraStep
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
def kernels() -> ModuleType:
    return interpreted_one_launch()


def _run(
    kernels: ModuleType, fused: bool, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    scaling: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor, widths: tuple[int, ...],
    block_m: int, slots: int,
) -> torch.Tensor:  # fmt: skip
    """y (a column slice of a wider output) plus the kernels' deltas, the partial sums' scratch
    poisoned with NaN (rows of no adapter are never written there, so never read)."""
    seg = kernels.segments(token_slots, slots, block_m)
    part = torch.full(kernels.partials_shape(x, a, seg), float("nan"))
    if fused:
        sync = torch.zeros(kernels.sync_size(seg), dtype=torch.int32)
        kernels.lora_delta(x, a, b, y, scaling, seg, widths, sync, part)
        # Every program took a ticket, none gave up waiting, every real tile's splits each
        # signalled once.
        splits = part.shape[0]
        blocks = sum(-(-w // kernels.block_n(block_m)) for w in widths)
        assert int(sync[0]) == seg.tiles * (splits + blocks)
        assert int(sync[1]) == 0
        real = seg.tile_slot >= 0
        done = sync[2 : 2 + seg.tiles]
        assert torch.equal(done[real], torch.full_like(done[real], splits))
        assert not bool(done[~real].any())
        assert not bool(sync[2 + seg.tiles :].any())  # the row's padding
    else:
        kernels.lora_expand(kernels.lora_shrink(x, a, scaling, seg, part), b, y, seg, widths)
    return y


# Decode-sized (16-row chunks, tiles of 64 rows) and prefill-sized (64-row chunks, tiles of
# 256) steps; one projection and stacks of two and three; whole column blocks (EVEN_N) and
# not; input widths that are whole shrink blocks (EVEN_K) and not; every slot with rows, slots
# with none, and a slot whose rows fill more than one tile (the last case: 300 rows of 2 slots).
CASES = [
    # tokens, in_f, widths, slots, max_rank, block_m
    (1, 256, (256,), 4, 16, 16),
    (37, 384, (256, 128, 128), 8, 16, 16),
    (64, 320, (72, 40, 40), 6, 8, 16),
    (96, 512, (512, 512), 3, 16, 16),
    (130, 256, (200,), 5, 32, 64),
    (300, 256, (128, 128), 2, 16, 16),
]


@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launch"])
@pytest.mark.parametrize(("tokens", "in_f", "widths", "slots", "max_rank", "block_m"), CASES)
def test_kernels_match_the_float64reference(
    kernels: ModuleType,
    fused: bool,
    tokens: int,
    in_f: int,
    widths: tuple[int, ...],
    slots: int,
    max_rank: int,
    block_m: int,
) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    a, b, scaling = random_stack(in_f, widths, slots, max_rank, gen)
    x = torch.randn(tokens, in_f, generator=gen)
    token_slots = torch.randint(0, slots, (tokens,), generator=gen)
    token_slots[torch.rand(tokens, generator=gen) < 0.25] = -1
    out_f = sum(widths)
    wide = torch.randn(tokens, out_f + 48, generator=gen)
    expected = reference(x, a, b, scaling, token_slots, wide[:, 16 : 16 + out_f], widths)
    got = wide.clone()
    _run(kernels, fused, x, a, b, scaling, token_slots, got[:, 16 : 16 + out_f], widths,
         block_m, slots)  # fmt: skip
    torch.testing.assert_close(got[:, 16 : 16 + out_f].double(), expected, atol=1e-4,
                               rtol=1e-4, msg=lambda m: f"seed {seed}: {m}")  # fmt: skip
    base_rows = token_slots < 0
    assert torch.equal(got[base_rows], wide[base_rows]), seed
    assert torch.equal(got[:, :16], wide[:, :16]), seed
    assert torch.equal(got[:, 16 + out_f :], wide[:, 16 + out_f :]), seed
    # A kernel that dropped the deltas fails: the adapter rows moved, by what they should.
    moved = (got[:, 16 : 16 + out_f] - wide[:, 16 : 16 + out_f])[~base_rows].abs().amax(1)
    want = (expected - wide[:, 16 : 16 + out_f].double())[~base_rows].abs().amax(1)
    assert bool((moved.double() > 0.5 * want).all()), seed


def test_one_launch_and_two_launches_agree_bit_for_bit(kernels: ModuleType) -> None:
    """The same partial sums summed in the same order: graphs (one path) and any rerun agree."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    widths, slots = (128, 64, 64), 5
    a, b, scaling = random_stack(512, widths, slots, 16, gen)
    x = torch.randn(48, 512, generator=gen)
    token_slots = torch.randint(-1, slots, (48,), generator=gen)
    y = torch.randn(48, sum(widths), generator=gen)
    outs = [
        _run(kernels, fused, x, a, b, scaling, token_slots, y.clone(), widths, 16, slots)
        for fused in (True, False, True)
    ]
    assert torch.equal(outs[0], outs[1]), seed
    assert torch.equal(outs[0], outs[2]), seed


@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launch"])
def test_a_nan_slot_reaches_no_other_row(kernels: ModuleType, fused: bool) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    widths = (64, 32, 32)
    a, b, scaling = random_stack(256, widths, 4, 16, gen)
    a[2] = float("nan")
    b[2] = float("nan")
    token_slots = torch.tensor([2, 0, -1, 2, 1, -1, 3, 0] * 4)
    x = torch.randn(32, 256, generator=gen)
    y = torch.randn(32, sum(widths), generator=gen)
    expected = reference(x, a, b, scaling, token_slots, y, widths)
    got = _run(kernels, fused, x, a, b, scaling, token_slots, y.clone(), widths, 16, 4)
    poisoned = token_slots == 2
    assert bool(got[poisoned].isnan().all())
    assert not bool(got[~poisoned].isnan().any())
    torch.testing.assert_close(got[~poisoned].double(), expected[~poisoned], atol=1e-4,
                               rtol=1e-4)  # fmt: skip


def test_a_wait_that_gives_up_writes_nan_into_its_tile_only(kernels: ModuleType) -> None:
    """The one-launch path's bounded wait: a tile whose splits never all signal (its counter
    set below zero here), in a launch whose failure flag is already raised (so the wait ends
    at once instead of after its ~10^6 polls), gets NaN rows; the other tiles are right."""
    gen = torch.Generator().manual_seed(fresh_seed())
    widths = (64,)
    a, b, scaling = random_stack(256, widths, 3, 16, gen)
    token_slots = torch.tensor([0, 1, 2, -1] * 6)
    x = torch.randn(24, 256, generator=gen)
    y = torch.randn(24, 64, generator=gen)
    expected = reference(x, a, b, scaling, token_slots, y, widths)
    seg = kernels.segments(token_slots, 3)
    sync = torch.zeros(kernels.sync_size(seg), dtype=torch.int32)
    stuck = int((seg.tile_slot == 1).nonzero()[0])
    sync[1] = 1
    sync[2 + stuck] = -1000
    got = y.clone()
    kernels.lora_delta(x, a, b, got, scaling, seg, widths, sync)
    assert int(sync[1]) > 1  # the waiters of the stuck tile counted their giving up
    assert bool(got[token_slots == 1].isnan().all())
    others = token_slots != 1
    assert not bool(got[others].isnan().any())
    torch.testing.assert_close(got[others].double(), expected[others], atol=1e-4, rtol=1e-4)


def test_bad_scratch_and_counters_are_refused(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    a, b, scaling = random_stack(256, (64,), 2, 16, gen)
    x, y = torch.randn(8, 256), torch.randn(8, 64)
    seg = kernels.segments(torch.zeros(8, dtype=torch.long), 2)
    before = y.clone()
    with pytest.raises(ValueError, match="sync"):
        kernels.lora_delta(x, a, b, y, scaling, seg, (64,), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="partial sums"):
        kernels.lora_delta(x, a, b, y, scaling, seg, (64,),
                           torch.zeros(kernels.sync_size(seg), dtype=torch.int32),
                           torch.empty(1, 8, 8))  # fmt: skip
    with pytest.raises(ValueError, match="columns"):
        kernels.lora_delta(x, a, b, y, scaling, seg, (32, 32),
                           torch.zeros(kernels.sync_size(seg), dtype=torch.int32))  # fmt: skip
    assert torch.equal(y, before)


@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launch"])
def test_the_kernels_step_matches_the_pytorch_step(kernels: ModuleType, fused: bool) -> None:
    """SegmentedLoraStep over LoraSlots with this path's launcher (every stack at once, and
    each projection alone into its columns) against lora/slots.py's SegmentedTorchStep, more
    launches than a layer's four (its counter rows run out and new zeroed ones are taken)."""
    base = small_shapes()
    slots = LoraSlots(base, num_slots=6, max_rank=16, dtype=torch.float32,
                      device=torch.device("cpu"))  # fmt: skip
    by_name = {adapter.name: adapter for adapter in mixed_adapters(base)}
    assigned = slots.assign(by_name, by_name.__getitem__)
    rng = random.Random(fresh_seed())
    names = ["", *by_name]
    token_slots = torch.tensor([-1 if not n else assigned[n] for n in rng.choices(names, k=40)])
    launches = kernels.OneLaunchLauncher(token_slots, slots.num_slots, 4 * base.num_layers, fused)
    step = SegmentedLoraStep(slots, launches)
    reference = SegmentedTorchStep(slots, token_slots)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    for layer in range(base.num_layers):
        for projections in (QKV, ("o_proj",), GATE_UP, ("down_proj",)):
            in_f = base.features[projections[0]][0]
            out_f = sum(base.features[p][1] for p in projections)
            x = torch.randn(40, in_f, generator=generator)
            y = torch.randn(40, out_f, generator=generator)
            want, got, each = y.clone(), y.clone(), y.clone()
            reference.add_stack(layer, projections, x, want)
            step.add_stack(layer, projections, x, got)
            first = 0
            for proj in projections:
                width = base.features[proj][1]
                step.add(layer, proj, x, each[:, first : first + width])
                first += width
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(each, want, atol=1e-4, rtol=1e-4)
            assert not torch.equal(want, y), (layer, projections)
