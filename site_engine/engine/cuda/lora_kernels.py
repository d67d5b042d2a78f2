"""Segmented multi-LoRA kernels (Punica's SGMV, S-LoRA's MBGMV, vLLM's fused lora_shrink and
lora_expand): each row's delta through its own adapter only, for a stack of projections at once,
shrink and expand in one launch. Not the engine's default (LoraSettings.kernels "one_launch"
selects it; cuda/lora_segmented.py is the default: lora/segmented_step.py gives the H200 times).

For a stack of projections that read the same input (q/k/v, gate/up: lora/slots.py's `Stack`),
and a step's tokens grouped by slot into tiles (cuda/lora_segments.py: a tile is a slot's whole
run when it fits, so a decode step reads each slot's weights once):

    shrink  s[t, :]      = scaling[slot] * x[t, :] @ A[slot]        ([in] @ [in, n * R])
    expand  y[t, cols_j] += s[t, j*R : (j+1)*R] @ B[slot][:, cols_j]  (each projection j)

both products on tensor cores (tl.dot; a chunk of 16 rows at decode, 64 at prefill). A slot
index of -1 (a base row, or graph padding) belongs to no tile: its row costs nothing and is left
untouched, bit for bit.

**One launch per stack** (`lora_delta`): the grid holds the shrink's tasks (tile x split of the
input features: a decode step of 64 adapters has few tiles and a long reduction, the splits keep
every SM reading) and then the expand's (tile x block of output columns). A program takes the
next task from an atomic ticket, so tasks start in ticket order: every shrink task has started
(it is running or done) before any expand task does. An expand task loads its slot's B block,
then waits until every split of its tile's shrink has signalled (a release increment after its
partial sums are written; the waiter polls with volatile loads, then acquires), sums the splits'
partial planes and adds its product into y in the same pass (y read once, written once). The
wait cannot deadlock: what it waits for never waits. The wait is bounded (about a second): past
it the tile's rows are written NaN, a loud failure instead of a hung GPU. Partial sums go to
planes of a float32 buffer, no float atomics: a step's result does not depend on the order
programs ran in (graphs and eager runs agree bit for bit). The per-launch counters are one row
of a zeroed int32 buffer per launch of the step (`OneLaunchLauncher`), zeroed once a step; a
wait that gave up raises the row's failure flag, and the launch's other waiters stop at once.

`lora_shrink` and `lora_expand` run the same two halves as two launches (the expand waiting for
nothing); `OneLaunchLauncher(fused=False)` uses them. The kernel itself is cuda/lora_triton.py's;
this module plans its launches (tile and block sizes, splits: ptxas-checked register and shared
memory budgets, in the functions' docstrings).

Everything that depends on which rows use which slot is computed on the device (segments): a
CUDA graph captured over a static slot-index buffer replays a step's layout. The slot tensors
are lora/slots.py's (per layer A [slots, in, n * R], B [slots, R, out], each slot's block
contiguous, so weight reads are long and coalesced); ranks are zero-padded to the site's max
rank R, so mixed ranks cost the padded rank. Offsets into the slot tensors are formed in 64 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from site_engine.engine.cuda.lora_segments import (
    DECODE_BLOCK_M,
    Segments,
    chunk_rows,
    max_tiles,
    segments,
)
from site_engine.engine.cuda.lora_triton import _lora_delta_kernel

__all__ = [
    "MAX_STACK",
    "OneLaunchLauncher",
    "Segments",
    "chunk_rows",
    "lora_delta",
    "lora_expand",
    "lora_shrink",
    "max_tiles",
    "partials_shape",
    "segments",
    "sync_size",
]

_BLOCK_N = 128  # expand columns per program for prefill chunks (64 rows)
_DECODE_BLOCK_N = 256  # for decode chunks (16 rows): fewer, wider programs, same registers
_MAX_SPLITS = 16
_SPLIT_FEATURES = 512  # input features per shrink task, at least
_PROGRAMS = 2048  # shrink tasks to aim for (a few per SM of an H100/H200)
_PARTIAL_BYTES = 8 << 20  # the shrink's partial sums at most (the memory plan's LoRA slack)
MAX_STACK = 3  # projections a stack may hold (q/k/v)
SHRINK, EXPAND, FUSED = 1, 2, 0  # what a launch runs


def _block(width: int) -> int:
    return max(16, int(triton.next_power_of_2(width)))


def block_n(block_m: int) -> int:
    """Output columns per expand program: 256 for decode chunks (16 rows: an expand program's
    cost is its chain of dependent loads, so fewer, wider programs), 128 for prefill chunks
    (64 rows: the accumulator is already 8,192 elements)."""
    return _DECODE_BLOCK_N if block_m == DECODE_BLOCK_M else _BLOCK_N


def split_k(in_features: int, tiles: int, tokens: int, width: int) -> int:
    """Splits of the input features: at least _SPLIT_FEATURES features each, about _PROGRAMS
    shrink tasks in all, at most _MAX_SPLITS, and partial sums of at most _PARTIAL_BYTES (a
    prefill step of 8k tokens at rank 64 takes one split)."""
    by_grid = _PROGRAMS // max(1, tiles)
    by_memory = _PARTIAL_BYTES // max(1, tokens * width * 4)
    return max(1, min(_MAX_SPLITS, in_features // _SPLIT_FEATURES, by_grid, by_memory))


def block_k(block_w: int, block_m: int) -> int:
    """Input features per shrink iteration: an A tile of at most 4,096 elements (64 x 64 for
    q/k/v, 128 x 32 for gate/up, 256 x 16 for one rank-16 projection) and an x tile of at most
    8,192 (128 features for prefill's 64-row chunks). With three stages in flight that is ~80-100
    registers a thread and ~21-33 KB of shared memory at decode, 5-6 programs an SM (ptxas for
    sm_90; 128 x 64 A tiles took 128 registers and 40 KB, 4 programs)."""
    return max(32, min(256, 4096 // block_w, 8192 // block_m))


def num_warps(block_m: int, block_n: int, block_r: int) -> int:
    """8 warps past 4,096 float32 accumulators or 8,192 B elements a program (64 registers a
    thread at 4 warps), so wide tiles do not spill."""
    return 8 if block_m * block_n > 4096 or block_r * block_n > 8192 else 4


@dataclass(frozen=True, slots=True)
class _Plan:
    """One stack launch's shapes and constants."""

    splits: int
    k_per_split: int
    block_k: int
    block_w: int
    cols: int
    blocks: int
    widths: tuple[int, int, int]


def _plan(x: torch.Tensor, a: torch.Tensor, seg: Segments, widths: tuple[int, ...]) -> _Plan:
    tokens, in_f = x.shape
    width = a.shape[2]
    splits = split_k(in_f, seg.tiles, tokens, width)
    block_w = _block(width)
    step = block_k(block_w, seg.block_m)
    cols = block_n(seg.block_m)
    blocks = sum(triton.cdiv(w, cols) for w in widths)
    padded = (*widths, 0, 0)[:MAX_STACK]
    k_per_split = triton.cdiv(triton.cdiv(in_f, splits), step) * step
    return _Plan(splits, k_per_split, step, block_w, cols, blocks, padded)  # type: ignore[arg-type]


def _check(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, widths: tuple[int, ...]) -> None:
    _, rank, out_f = b.shape
    if not 1 <= len(widths) <= MAX_STACK or sum(widths) != out_f or y.shape[1] != out_f:
        raise ValueError(
            f"widths {widths}: the output has {y.shape[1]} columns, the adapters' B {out_f}"
        )
    if a.shape[2] != rank * len(widths):
        raise ValueError(f"A has {a.shape[2]} columns for {len(widths)} x rank {rank}")


def _launch(
    phase: int,
    grid: int,
    ops: tuple[torch.Tensor, ...],
    seg: Segments,
    plan: _Plan,
    rank: int,
) -> None:
    """One launch of `phase` over ops (x, a, part, b, y, scaling, sync): a launch that runs
    one half only is given stand-ins for the other half's tensors, which it does not read."""
    x, a, part, b, y, scaling, sync = ops
    if any(t.stride(-1) != 1 for t in (x, a, part, b, y)):
        raise ValueError("the LoRA kernels need unit stride along the features")
    block_r = _block(rank)
    warps = 4
    if phase != EXPAND:
        warps = max(warps, num_warps(seg.block_m, plan.block_w, plan.block_w))
    if phase != SHRINK:
        warps = max(warps, num_warps(seg.block_m, plan.cols, block_r))
    _lora_delta_kernel[(grid,)](
        x, a, part, b, y, scaling, seg.order, seg.tile_slot, seg.tile_start, seg.tile_end, sync,
        x.shape[1], plan.k_per_split, plan.splits, plan.blocks, seg.tiles,
        x.stride(0), a.stride(0), a.stride(1), part.stride(0), part.stride(1),
        b.stride(0), b.stride(1), y.stride(0),
        PHASE=phase, WIDTH=part.shape[2], WIDTH0=plan.widths[0], WIDTH1=plan.widths[1],
        WIDTH2=plan.widths[2], RANK=rank, BLOCK_M=seg.block_m, BLOCK_K=plan.block_k,
        BLOCK_W=plan.block_w, BLOCK_R=block_r, BLOCK_N=plan.cols,
        SPLITS=int(triton.next_power_of_2(plan.splits)),
        EVEN_K=x.shape[1] % plan.block_k == 0,
        EVEN_N=all(w % plan.cols == 0 for w in plan.widths),
        IEEE=a.dtype == torch.float32, num_warps=warps,
    )  # fmt: skip


def sync_size(seg: Segments) -> int:
    """Counters one lora_delta launch needs: its ticket, its failure flag, one per tile; padded
    to 16 bytes, so every row of OneLaunchLauncher's counters is 16-byte aligned (one Triton
    specialization, compiled by the warm-up before a graph capture, not during it)."""
    return -(-(2 + seg.tiles) // 4) * 4


def partials_shape(x: torch.Tensor, a: torch.Tensor, seg: Segments) -> tuple[int, int, int]:
    """The shrink's partial sums for x [T, in] and a [slots, in, width]: [splits, T, width],
    float32."""
    return _plan(x, a, seg, (a.shape[2],)).splits, x.shape[0], a.shape[2]


def _partials(
    x: torch.Tensor, a: torch.Tensor, plan: _Plan, given: torch.Tensor | None
) -> torch.Tensor:
    shape = (plan.splits, x.shape[0], a.shape[2])
    if given is None:
        return torch.empty(shape, dtype=torch.float32, device=x.device)
    if tuple(given.shape) != shape or given.dtype != torch.float32 or not given.is_contiguous():
        raise ValueError(f"partial sums: {tuple(given.shape)} {given.dtype}, need {shape} float32")
    return given


def lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    scaling: torch.Tensor,
    seg: Segments,
    widths: tuple[int, ...],
    sync: torch.Tensor,
    part: torch.Tensor | None = None,
) -> None:
    """y[t, cols_j] += (scaling[slot_t] * x[t] @ a[slot_t][:, j*R:(j+1)*R]) @ b[slot_t][:, cols_j]
    for each projection j of the stack, in one launch: x [T, in], a [slots, in, n * R], b
    [slots, R, out] (one layer of a stack's slots, or a column slice), y [T, out] (may be a
    column slice of a wider output), `widths` the projections' output columns, side by side.
    `sync`: int32, sync_size(seg) elements, zero, used by this launch only (after it: the
    programs' count, 0 (1 or more: some wait gave up and wrote NaN), and each tile's splits
    done). `part`: the
    partial sums' scratch (default: allocated here; see partials_shape)."""
    _check(a, b, y, widths)
    if sync.dtype != torch.int32 or sync.numel() < sync_size(seg):
        raise ValueError(f"sync must be int32 with {sync_size(seg)} elements at least")
    plan = _plan(x, a, seg, widths)
    part = _partials(x, a, plan, part)
    grid = seg.tiles * (plan.splits + plan.blocks)
    _launch(FUSED, grid, (x, a, part, b, y, scaling, sync), seg, plan, b.shape[1])


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    scaling: torch.Tensor,
    seg: Segments,
    part: torch.Tensor | None = None,
) -> torch.Tensor:
    """The shrink alone: partial sums [splits, T, width] (float32) of scaling[slot_t] * x[t] @
    a[slot_t]; rows of no slot are left unwritten (lora_expand sums them). `part`: the scratch
    to write them into (default: allocated here; see partials_shape)."""
    plan = _plan(x, a, seg, (a.shape[2],))
    part = _partials(x, a, plan, part)
    ops = (x, a, part, a, x, scaling, seg.order)  # the expand half's are stand-ins
    _launch(SHRINK, seg.tiles * plan.splits, ops, seg, plan, 16)
    return part


def lora_expand(
    part: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    seg: Segments,
    widths: tuple[int, ...],
) -> None:
    """The expand alone: y[t, cols_j] += part[:, t, j*R : (j+1)*R].sum(0) @ b[slot_t][:, cols_j],
    in place, `part` from lora_shrink of the same segments."""
    splits, _tokens, width = part.shape
    rank = b.shape[1]
    if width != rank * len(widths):
        raise ValueError(f"the shrink gave {width} columns for {len(widths)} x {rank}")
    _check(part, b, y, widths)
    cols = block_n(seg.block_m)
    blocks = sum(triton.cdiv(w, cols) for w in widths)
    padded = (*widths, 0, 0)[:MAX_STACK]
    plan = _Plan(splits, 0, 16, _block(width), cols, blocks, padded)  # type: ignore[arg-type]
    ops = (y, b, part, b, y, y, seg.order)  # the shrink half's are stand-ins
    _launch(EXPAND, seg.tiles * blocks, ops, seg, plan, rank)


class OneLaunchLauncher:
    """A step's launches on this path (lora/segmented_step.py's StackLauncher, the engine's
    LoraSettings.kernels "one_launch"): one launch per stack (fused=False: two)."""

    def __init__(
        self, token_slots: torch.Tensor, num_slots: int, launches: int, fused: bool = True
    ) -> None:
        self._fused = fused
        # Once per step, shared by every layer and projection.
        self._segments = segments(token_slots, num_slots)
        self._device = token_slots.device
        # One zeroed row of counters per fused launch: `launches` rows (the fused model's four
        # a layer), more allocated (zeroed) if a caller launches more.
        self._rows = max(1, launches)
        self._sync = self._sync_rows()
        self._used = 0

    def _sync_rows(self) -> torch.Tensor:
        return torch.zeros((self._rows, sync_size(self._segments)), dtype=torch.int32,
                           device=self._device)  # fmt: skip

    def _next_sync(self) -> torch.Tensor:
        if self._used == self._sync.shape[0]:
            self._sync, self._used = self._sync_rows(), 0
        row = self._sync[self._used]
        self._used += 1
        return row

    def run(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
        scaling: torch.Tensor, widths: tuple[int, ...],
    ) -> None:  # fmt: skip
        """y += each row's delta of the stack (`widths`: its projections' output columns)."""
        seg = self._segments
        if self._fused:
            lora_delta(x, a, b, y, scaling, seg, widths, self._next_sync())
        else:
            lora_expand(lora_shrink(x, a, scaling, seg), b, y, seg, widths)
