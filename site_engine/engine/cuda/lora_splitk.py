"""Split-K multi-LoRA kernels (issue 77; LoraSettings.kernels "splitk"): each row's delta
through its own adapter only, for a stack of projections at once, in two launches whose work is
sized on the device from the step's real tiles, not the worst case the grid was captured for.

For a stack of projections that read the same input (q/k/v, gate/up: lora/slots.py's `Stack`),
and a step's tokens grouped by slot into tiles of up to `tile_rows` rows of one slot
(cuda/lora_segments.py; 32 rows at decode by default, so a decode step of 8 adapters over 256
rows has one tile a slot and reads each slot's A and B once):

    shrink  s[t, :]      = scaling[slot] * x[t, :] @ A[slot]        ([in] @ [in, n * R])
    expand  y[t, cols_j] += s[t, j*R : (j+1)*R] @ B[slot][:, cols_j]  (each projection j)

**Shrink**: a fixed grid of `_SHRINK_PROGRAMS` programs; with n real tiles (read from the
device) each tile's input features are split `splits` = min(_MAX_SPLITS, programs // n,
in // _SPLIT_FEATURES) ways, so 8 adapters get as many programs reading as 64 do, and a prefill
step of more tiles than programs walks them with one split each. Each split writes its float32
partial sums to a scratch plane of its own, then counts itself on its tile's counter (a release
increment); the split that arrives last sums the tile's planes in split order and writes s, and
sets the counter back to zero for the next launch. No float atomics and no waiting: a tile's s
does not depend on the order its programs ran in (graph replays and eager runs agree bit for
bit), and the expand reads one s per row, not every plane per column block.

**Expand**: a fixed grid of `_EXPAND_PROGRAMS` programs; each real tile's output columns are
cut into as many runs of `_BLOCK_N`-column blocks as the programs allow, and a program walks its
run: its rows and s are loaded once, then per block B's block and y's rows, y += s @ B, written
back in the same pass (the add is the expand's own read and write of y, no separate add).

**PDL** (`_PDL`, Hopper only): both launches may start before the kernel in front of them has
finished (programmatic dependent launch). The shrink waits for it before reading anything, then
lets the expand launch; the expand reads the step's tiles (written by the slot sort, long
finished) before its wait and s and y only after it, so its launch and prologue overlap the
shrink's tail. Each kernel's completion still implies its predecessors': the next ordinary
launch sees everything.

Widths, ranks and block sizes are kernel constants, so masks along the contiguous dimension are
constant over 16-byte runs and the loads vectorize (docs/engine-gpu.md, issue 69: masks on run-
time widths made every element a scalar load). A slot index of -1 (a base row, or graph padding)
belongs to no tile: its row costs nothing and is left untouched, bit for bit. The slot tensors
are lora/slots.py's (per layer A [slots, in, n * R], B [slots, R, out], each slot's block
contiguous); ranks are zero-padded to the site's max rank R. Offsets into the slot tensors are
formed in 64 bits.

The planning constants below are the module's tunables (bench/engine/lora_kernel_bench.py times
variants of them on the GPU by setting them on the module); nothing here syncs with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from site_engine.engine.cuda.lora_segments import (
    MAX_STACK,
    check_stack,
    max_tiles,
    slot_tiles,
    sorted_by_slot,
)

_DECODE_TILE_ROWS = 32  # rows of one slot a program takes (tl.dot's M), steps of <= 512 tokens
_PREFILL_TILE_ROWS = 64
_PREFILL_TOKENS = 512
_SHRINK_PROGRAMS = 512  # the shrink's grid: ~4 programs an SM of an H100/H200's 132
_EXPAND_PROGRAMS = 1024
_MAX_SPLITS = 16
_SPLIT_FEATURES = 256  # input features a split reads at least
_BLOCK_K = 128  # input features per shrink iteration (at most; less for wide tiles)
_BLOCK_N = 256  # output columns per expand block (less for wide tiles: block_n)
_PDL = False  # programmatic dependent launch (Hopper), off until the GPU run says it pays
_SCRATCH_BYTES = 8 << 20  # the shrink's partial sums at most (the memory plan's LoRA slack)


@dataclass(frozen=True, slots=True)
class Segments:
    """A step's tokens grouped by slot, as device tensors of fixed shapes (graph-safe)."""

    tile_rows: int  # rows a tile holds at most (the kernels' M)
    order: torch.Tensor  # [T] int32: token indices sorted by slot (base rows first)
    tile_slot: torch.Tensor  # [tiles] int32: a tile's slot, -1 past the real tiles
    tile_start: torch.Tensor  # [tiles] int32: its first position in `order`
    tile_end: torch.Tensor  # [tiles] int32: the end of its slot's run in `order`
    n_tiles: torch.Tensor  # [1] int32: the real tiles

    @property
    def tiles(self) -> int:
        return int(self.tile_slot.shape[0])


def tile_rows(tokens: int) -> int:
    """Rows a tile holds for a step of `tokens` (a graph's bucket: fixed per graph)."""
    return _DECODE_TILE_ROWS if tokens <= _PREFILL_TOKENS else _PREFILL_TILE_ROWS


def segments(token_slots: torch.Tensor, num_slots: int, rows: int | None = None) -> Segments:
    """The tiles of a step whose token t uses slot token_slots[t] (-1: none), `rows` tokens
    each at most (default: tile_rows)."""
    tokens = token_slots.shape[0]
    rows = tile_rows(tokens) if rows is None else rows
    if rows < 16 or rows & (rows - 1):
        raise ValueError(f"tile rows must be a power of two >= 16, got {rows}")
    order, starts, counts = sorted_by_slot(token_slots, num_slots)
    tiles = max_tiles(tokens, num_slots, rows)
    tile_slot, tile_start, tile_end, n_tiles = slot_tiles(starts, counts, rows, tiles)
    return Segments(rows, order, tile_slot, tile_start, tile_end, n_tiles)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, part_ptr, s_ptr, count_ptr, scaling_ptr,
    order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, n_tiles_ptr,
    k_total, max_splits, sx_t, sa_s, sa_k, ss_t,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, TILE_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    programs = tl.num_programs(0)
    n = tl.load(n_tiles_ptr)
    splits = tl.maximum(1, tl.minimum(max_splits, programs // tl.maximum(n, 1)))
    # Whole BLOCK_K blocks a split, and no split without features.
    k_per_split = (k_total + splits * BLOCK_K - 1) // (splits * BLOCK_K) * BLOCK_K
    splits = (k_total + k_per_split - 1) // k_per_split
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < WIDTH
    offs_m = tl.arange(0, TILE_M)
    for work in range(tl.program_id(0), n * splits, programs):
        tile = work // splits
        split = work - tile * splits
        slot = tl.load(tile_slot_ptr + tile)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        mask_m = start + offs_m < end
        tok = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
        x_rows = x_ptr + tok[:, None] * sx_t
        a_slot = a_ptr + slot.to(tl.int64) * sa_s
        k_begin = split * k_per_split
        k_stop = tl.minimum(k_begin + k_per_split, k_total)
        acc = tl.full((TILE_M, BLOCK_W), 0.0, dtype=tl.float32)
        for k0 in range(k_begin, k_stop, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a_block = a_slot + offs_k[:, None].to(tl.int64) * sa_k + offs_w[None, :]
            if EVEN_K:
                a = tl.load(a_block, mask=mask_w[None, :], other=0.0)
                x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            else:
                mask_k = offs_k < k_stop
                a = tl.load(a_block, mask=mask_k[:, None] & mask_w[None, :], other=0.0)
                x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                            other=0.0)  # fmt: skip
            if IEEE:
                acc += tl.dot(x, a, input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        scale = tl.load(scaling_ptr + slot).to(tl.float32)
        out_mask = mask_m[:, None] & mask_w[None, :]
        s_rows = s_ptr + tok[:, None] * ss_t + offs_w[None, :]
        if splits == 1:
            tl.store(s_rows, acc * scale, mask=out_mask)
        else:
            # Plane `work` of the scratch [programs, TILE_M, WIDTH] (int32 offsets: the scratch
            # is at most _SCRATCH_BYTES), a work item's own rows.
            plane = part_ptr + offs_m[:, None] * WIDTH + offs_w[None, :]
            tl.store(plane + work * (TILE_M * WIDTH), acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partial sums stored before the release
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == splits - 1:
                total = tl.full((TILE_M, BLOCK_W), 0.0, dtype=tl.float32)
                first = tile * splits
                # Unrolled: every plane's load in flight at once, summed in split order.
                for p in tl.static_range(SPLITS):
                    total += tl.load(plane + (first + p) * (TILE_M * WIDTH),
                                     mask=out_mask & (p < splits), other=0.0,
                                     cache_modifier=".cg")  # fmt: skip
                tl.store(s_rows, total * scale, mask=out_mask)
                tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, n_tiles_ptr,
    ss_t, sb_s, sb_r, sy_t,
    WIDTH0: tl.constexpr, WIDTH1: tl.constexpr, WIDTH2: tl.constexpr, RANK: tl.constexpr,
    BLOCK_R: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
    PDL: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Each projection's columns start a block of their own; with EVEN_N every width is whole
    # blocks, so block `blk` starts at column blk * BLOCK_N.
    blocks0: tl.constexpr = (WIDTH0 + BLOCK_N - 1) // BLOCK_N
    blocks1: tl.constexpr = (WIDTH1 + BLOCK_N - 1) // BLOCK_N
    blocks: tl.constexpr = blocks0 + blocks1 + (WIDTH2 + BLOCK_N - 1) // BLOCK_N
    programs = tl.num_programs(0)
    n = tl.load(n_tiles_ptr)
    per_tile = tl.maximum(1, tl.minimum(blocks, programs // tl.maximum(n, 1)))
    run = (blocks + per_tile - 1) // per_tile
    per_tile = (blocks + run - 1) // run  # no program without a block
    offs_m = tl.arange(0, TILE_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    offs_n = tl.arange(0, BLOCK_N)
    for work in range(tl.program_id(0), n * per_tile, programs):
        tile = work // per_tile
        first = (work - tile * per_tile) * run
        slot = tl.load(tile_slot_ptr + tile)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        mask_m = start + offs_m < end
        tok = tl.load(order_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
        b_slot = b_ptr + slot.to(tl.int64) * sb_s + offs_r[:, None] * sb_r
        s_rows = s_ptr + tok[:, None] * ss_t + offs_r[None, :]
        y_rows = y_ptr + tok[:, None] * sy_t
        mask_s = mask_m[:, None] & mask_r[None, :]
        if PDL:
            tl.extra.cuda.gdc_wait()  # s (the shrink's) and y (the base GEMM's) from here on
            tl.extra.cuda.gdc_launch_dependents()
        for blk in range(first, tl.minimum(first + run, blocks)):
            in1 = blk >= blocks0
            in2 = blk >= blocks0 + blocks1
            part = in1.to(tl.int32) + in2.to(tl.int32)
            # The s of this block's projection: a few hundred bytes, from L1 after the first.
            shrunk = tl.load(s_rows + part * RANK, mask=mask_s, other=0.0)
            if EVEN_N:
                cols = blk * BLOCK_N + offs_n
                b = tl.load(b_slot + cols[None, :], mask=mask_r[:, None], other=0.0)
                mask_y = mask_m[:, None]
            else:
                first_col = tl.where(in2, WIDTH0 + WIDTH1, tl.where(in1, WIDTH0, 0))
                width = tl.where(in2, WIDTH2, tl.where(in1, WIDTH1, WIDTH0))
                first_block = tl.where(in2, blocks0 + blocks1, tl.where(in1, blocks0, 0))
                local = (blk - first_block) * BLOCK_N + offs_n
                mask_n = local < width
                cols = (first_col + local).to(tl.int64)
                b = tl.load(b_slot + cols[None, :], mask=mask_r[:, None] & mask_n[None, :],
                            other=0.0)  # fmt: skip
                mask_y = mask_m[:, None] & mask_n[None, :]
            # The delta from s in the weights' dtype, as the PyTorch path rounds it; float32 sums.
            if IEEE:
                delta = tl.dot(shrunk.to(b.dtype), b, input_precision="ieee")
            else:
                delta = tl.dot(shrunk.to(b.dtype), b)
            y = tl.load(y_rows + cols[None, :], mask=mask_y, other=0.0)
            tl.store(y_rows + cols[None, :], (y.to(tl.float32) + delta).to(y.dtype), mask=mask_y)


def _block(width: int) -> int:
    return max(16, int(triton.next_power_of_2(width)))


def block_k(rows: int, block_w: int) -> int:
    """Input features per shrink iteration: x and A tiles of at most 8,192 elements each."""
    return max(16, min(_BLOCK_K, 8192 // rows, 8192 // block_w))


def block_n(rows: int, element: int = 2) -> int:
    """Output columns per expand block: a y tile of at most 16 KB (8,192 bf16 elements; float32
    tiles of that many spill at 32 rows)."""
    return max(16, min(_BLOCK_N, 16384 // (rows * element)))


def num_warps(elements: int) -> int:
    """8 warps for tiles past 4,096 elements (32 float32 registers a thread at 4), else 4 (float32
    operands count twice: the float32 dot's registers)."""
    return 8 if elements > 4096 else 4


@cache
def _pdl(device: torch.device) -> bool:
    """Programmatic dependent launch where it exists (sm_90 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def shrink_programs(rows: int, width: int) -> int:
    """The shrink's grid: _SHRINK_PROGRAMS, fewer where their partial planes would pass
    _SCRATCH_BYTES."""
    return max(1, min(_SHRINK_PROGRAMS, _SCRATCH_BYTES // (rows * width * 4)))


def _scratch(
    given: torch.Tensor | None, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    if given is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(given.shape) != shape or given.dtype != torch.float32 or not given.is_contiguous():
        raise ValueError(f"scratch {tuple(given.shape)} {given.dtype}: need {shape} float32")
    return given


def _unit_stride(*tensors: torch.Tensor) -> None:
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the LoRA kernels need unit stride along the features")


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    scaling: torch.Tensor,
    seg: Segments,
    counts: torch.Tensor,
    programs: int | None = None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """s [T, width] (float32) = scaling[slot_t] * x[t] @ a[slot_t]: x [T, in], a [slots, in,
    width] (one layer of a stack's slots, or a column slice of it). Rows of no slot are left
    unwritten. `counts`: int32, at least seg.tiles elements, zero (left zero). `programs`: the
    grid (default: shrink_programs). `out` (s) and `scratch` (the partial sums, [programs,
    tile rows, width] float32): allocated here unless given."""
    _unit_stride(x, a)
    tokens, in_f = x.shape
    width = a.shape[2]
    if counts.dtype != torch.int32 or counts.numel() < seg.tiles:
        raise ValueError(f"counts must be int32 with {seg.tiles} elements at least")
    rows, block_w = seg.tile_rows, _block(width)
    grid = shrink_programs(rows, width) if programs is None else programs
    step = block_k(rows, block_w)
    splits = max(1, min(_MAX_SPLITS, in_f // _SPLIT_FEATURES))
    s = _scratch(out, (tokens, width), x.device)
    part = _scratch(scratch, (grid, rows, width), x.device)
    pdl = _PDL and _pdl(x.device)
    _shrink_kernel[(grid,)](
        x, a, part, s, counts, scaling,
        seg.order, seg.tile_slot, seg.tile_start, seg.tile_end, seg.n_tiles,
        in_f, splits, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
        WIDTH=width, BLOCK_W=block_w, TILE_M=rows, BLOCK_K=step,
        SPLITS=int(triton.next_power_of_2(splits)), EVEN_K=in_f % step == 0, PDL=pdl,
        IEEE=x.dtype == torch.float32, num_warps=num_warps(rows * block_w), launch_pdl=pdl,
    )  # fmt: skip
    return s


def lora_expand(
    s: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    seg: Segments,
    widths: tuple[int, ...],
    programs: int | None = None,
) -> None:
    """y[t, cols_j] += s[t, j*R : (j+1)*R] @ b[slot_t][:, cols_j], in place, for each
    projection j of the stack (`widths`: their output columns, side by side in b and y): s from
    lora_shrink, b [slots, R, out] (one layer), y [T, out] (may be a column slice of a wider
    output). `programs`: the grid (default: _EXPAND_PROGRAMS)."""
    _unit_stride(s, b, y)
    check_stack(b, y, widths, s.shape[1])
    rank = b.shape[1]
    rows = seg.tile_rows
    cols = block_n(rows, y.element_size())
    padded = (*widths, 0, 0)[:MAX_STACK]
    blocks = sum(triton.cdiv(w, cols) for w in widths)
    grid = min(_EXPAND_PROGRAMS if programs is None else programs, seg.tiles * blocks)
    pdl = _PDL and _pdl(y.device)
    _expand_kernel[(max(1, grid),)](
        s, b, y, seg.order, seg.tile_slot, seg.tile_start, seg.tile_end, seg.n_tiles,
        s.stride(0), b.stride(0), b.stride(1), y.stride(0),
        WIDTH0=padded[0], WIDTH1=padded[1], WIDTH2=padded[2], RANK=rank, BLOCK_R=_block(rank),
        TILE_M=rows, BLOCK_N=cols, EVEN_N=all(w % cols == 0 for w in widths), PDL=pdl,
        IEEE=y.dtype == torch.float32, num_warps=num_warps(rows * cols * y.element_size() // 2),
        launch_pdl=pdl,
    )  # fmt: skip


class SplitKLauncher:
    """A step's launches on this path (lora/segmented_step.py's StackLauncher): the tiles and
    the shrink's tile counters made once for the step, shared by every layer and stack (the
    launches run one after another on the step's stream, and each leaves the counters zero)."""

    def __init__(self, token_slots: torch.Tensor, num_slots: int) -> None:
        self._segments = segments(token_slots, num_slots)
        self._counts = torch.zeros(self._segments.tiles, dtype=torch.int32,
                                   device=token_slots.device)  # fmt: skip

    def run(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
        scaling: torch.Tensor, widths: tuple[int, ...],
    ) -> None:  # fmt: skip
        """y += each row's delta of the stack (`widths`: its projections' output columns)."""
        seg = self._segments
        lora_expand(lora_shrink(x, a, scaling, seg, self._counts), b, y, seg, widths)
