"""Segmented LoRA kernels (Punica's SGMV, S-LoRA's MBGMV): each row's delta through its own
adapter only, for a stack of projections at once. The engine's one kernel path
(lora/segmented_step.py says why): the kernels as they were before issue 69's rewrite (git
show 807f967^:site_engine/engine/cuda/lora_kernels.py), with tl.zeros and tl.cdiv spelled out
(Triton's own @jit helpers, which the CPU tests' interpreter, turned on after triton's import,
cannot call; the compiled code is the same).

A step's tokens are grouped by slot (a counting sort of the slot indices) and cut into tiles of
16 tokens of one slot (64 in steps of more than 512 tokens: prefill); a program takes one tile.
For a stack of projections that read the same input (q/k/v, gate/up: lora/slots.py's `Stack`),
one shrink and one expand serve all of them, as vLLM's lora_shrink/lora_expand serve their
"slices":

    shrink  s[t, :]      = scaling[slot] * x[t, :] @ A[slot]        ([in] @ [in, n * R])
    expand  y[t, cols_j] += s[t, j*R : (j+1)*R] @ B[slot][:, cols_j]  (each projection j)

so each tile reads its slot's A and B once, every projection of the stack in one launch. A slot
index of -1 (a base row, or graph padding) belongs to no tile: its row costs nothing and is left
untouched, bit for bit.

Everything that depends on which rows use which slot is computed on the device by fixed-shape
torch ops from the slot-index tensor (`segments`): no host sync, so a CUDA graph captured over a
static slot-index buffer replays a step's layout that the host wrote into that buffer. The grid
is sized for the worst case, min(T, cdiv(T, tile) + slots) tiles (each slot in use has at
least one token per tile); programs past the real tiles return at once.

The shrink splits the input features over programs (a decode step of 64 adapters has few tiles
and a long reduction: the splits keep every SM reading; a prefill step has tiles enough, and
its partial sums are bounded to 8 MiB); each writes its partial sums to its own plane of a
float32 buffer and the expand adds the planes: no atomics, so a step's result does not depend
on the order programs ran in (graphs and eager runs agree bit for bit).

The slot tensors are lora/slots.py's (per layer A [slots, in, n * R], B [slots, R, out], each
slot's block contiguous, so a tile's weight reads are long and coalesced); ranks are zero-padded
to the site's max rank R, so mixed ranks cost the padded rank. Offsets into the slot tensors
are formed in 64 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

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

# Tokens per tile: tl.dot's smallest M for decode-sized steps, where a slot has a few rows;
# more for prefill-sized ones, so a slot's weights are read once per 64 of its tokens, not 16.
_TILE_ROWS = 16
_PREFILL_TILE_ROWS = 64
_PREFILL_TOKENS = 512  # steps of more tokens than this use the larger tiles
_BLOCK_K = 128  # at most; less for wide stacks (block_k), so a stage's tiles stay small
_BLOCK_N = 128
_DECODE_BLOCK_N = 256  # expand columns per program for decode-sized tiles (block_n says why)
_MAX_SPLITS = 16
_SPLIT_FEATURES = 512  # input features per shrink program, at least
_PROGRAMS = 2048  # shrink programs to aim for (a few per SM of an H100/H200)
_PARTIAL_BYTES = 8 << 20  # the shrink's partial sums at most (the memory plan's LoRA slack)


@dataclass(frozen=True, slots=True)
class Segments:
    """A step's tokens grouped by slot, as device tensors of fixed shapes (graph-safe)."""

    block_m: int  # tokens per tile
    order: torch.Tensor  # [T] int32: token indices sorted by slot (base rows first)
    tile_slot: torch.Tensor  # [tiles] int32: a tile's slot, -1 past the real tiles
    tile_start: torch.Tensor  # [tiles] int32: its first position in `order`
    tile_end: torch.Tensor  # [tiles] int32: the end of its slot's run in `order`


def tile_rows(tokens: int) -> int:
    """Tokens per tile for a step of `tokens` (a graph's bucket: fixed per graph)."""
    return _TILE_ROWS if tokens <= _PREFILL_TOKENS else _PREFILL_TILE_ROWS


def segments(token_slots: torch.Tensor, num_slots: int, block_m: int | None = None) -> Segments:
    """The tiles of a step whose token t uses slot token_slots[t] (-1: none), `block_m` tokens
    each (default: tile_rows): the sort and the tiles of cuda/lora_segments.py, each tile's end
    the end of its slot's run (the kernels take block_m rows of it at most)."""
    tokens = token_slots.shape[0]
    block_m = tile_rows(tokens) if block_m is None else block_m
    order, starts, counts = sorted_by_slot(token_slots, num_slots)
    tiles = max_tiles(tokens, num_slots, block_m)
    tile_slot, tile_start, tile_end = slot_tiles(starts, counts, block_m, tiles)
    return Segments(block_m, order, tile_slot, tile_start, tile_end)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, scaling_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    k_total, width, k_per_split,
    sx_t, sx_k, sa_s, sa_k, sa_r, so_split, so_t, so_r,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rows = start + tl.arange(0, BLOCK_M)
    mask_m = rows < end
    tok = tl.load(order_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < width
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, dtype=tl.float32)
    k_begin = split * k_per_split
    k_stop = tl.minimum(k_begin + k_per_split, k_total)
    a_slot = a_ptr + slot.to(tl.int64) * sa_s
    for k0 in range(k_begin, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_stop
        x = tl.load(
            x_ptr + tok[:, None] * sx_t + offs_k[None, :] * sx_k,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        a = tl.load(
            a_slot + offs_k[:, None].to(tl.int64) * sa_k + offs_r[None, :] * sa_r,
            mask=mask_k[:, None] & mask_r[None, :],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    acc *= tl.load(scaling_ptr + slot).to(tl.float32)
    out = out_ptr + split * so_split + tok[:, None] * so_t + offs_r[None, :] * so_r
    tl.store(out, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    width0, width1, width2, R, splits,
    ss_split, ss_t, ss_r, sb_s, sb_r, sb_n, sy_t, sy_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    # Which projection of the stack this program's columns belong to (a block never straddles
    # two: each projection's columns start a block of their own).
    blocks0 = (width0 + BLOCK_N - 1) // BLOCK_N
    blocks1 = (width1 + BLOCK_N - 1) // BLOCK_N
    in1 = pid_n >= blocks0
    in2 = pid_n >= blocks0 + blocks1
    part = in1.to(tl.int32) + in2.to(tl.int32)
    first_col = tl.where(in2, width0 + width1, tl.where(in1, width0, 0))
    width = tl.where(in2, width2, tl.where(in1, width1, width0))
    first_block = tl.where(in2, blocks0 + blocks1, tl.where(in1, blocks0, 0))
    offs_local = (pid_n - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_local < width
    cols = (first_col + offs_local).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rows = start + tl.arange(0, BLOCK_M)
    mask_m = rows < end
    tok = tl.load(order_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    mask_s = mask_m[:, None] & mask_r[None, :]
    shrunk = tl.full((BLOCK_M, BLOCK_R), 0.0, dtype=tl.float32)
    s_rows = s_ptr + tok[:, None] * ss_t + (part * R + offs_r)[None, :] * ss_r
    # Unrolled (SPLITS >= splits, a power of two): every plane's load is in flight at once,
    # not one L2 round trip after another as a loop over a run-time count would wait for.
    for split in tl.static_range(SPLITS):
        shrunk += tl.load(s_rows + split * ss_split, mask=mask_s & (split < splits), other=0.0)
    b = tl.load(
        b_ptr + slot.to(tl.int64) * sb_s + offs_r[:, None] * sb_r + cols[None, :] * sb_n,
        mask=mask_r[:, None] & mask_n[None, :],
        other=0.0,
    )
    # The delta in the weights' dtype, as the PyTorch path rounds it; accumulated in float32.
    if IEEE:
        delta = tl.dot(shrunk.to(b.dtype), b, input_precision="ieee")
    else:
        delta = tl.dot(shrunk.to(b.dtype), b)
    y_rows = y_ptr + tok[:, None] * sy_t + cols[None, :] * sy_n
    mask_y = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_rows, mask=mask_y, other=0.0)
    tl.store(y_rows, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_y)


def _block(width: int) -> int:
    return max(16, int(triton.next_power_of_2(width)))


def block_n(block_m: int) -> int:
    """Output columns per expand program. Decode-sized tiles (16 rows, a few of them real) take
    _DECODE_BLOCK_N: an expand program's cost is its chain of dependent loads (tile, order,
    partial planes, B and y), not its bytes, so fewer, wider programs do the same work in fewer
    round trips (a 256-row step of 64 adapters: 17,920 programs for gate/up at 128 columns,
    8,960 at 256), and each reads the shrink's partial planes for twice the columns. Prefill
    tiles (64 rows) keep _BLOCK_N: their accumulator is already 8,192 elements."""
    return _DECODE_BLOCK_N if block_m == _TILE_ROWS else _BLOCK_N


def split_k(in_features: int, tiles: int, tokens: int, width: int) -> int:
    """Programs the shrink splits the input features over: at least _SPLIT_FEATURES features
    each, about _PROGRAMS programs in all, at most _MAX_SPLITS, and partial sums of at most
    _PARTIAL_BYTES (a prefill step of 8k tokens at rank 64 takes one split)."""
    by_grid = _PROGRAMS // max(1, tiles)
    by_memory = _PARTIAL_BYTES // max(1, tokens * width * 4)
    return max(1, min(_MAX_SPLITS, in_features // _SPLIT_FEATURES, by_grid, by_memory))


def block_k(block_r: int) -> int:
    """Input features per shrink iteration: an A tile of at most 128 x 64 elements."""
    return max(32, min(_BLOCK_K, 8192 // block_r))


def num_warps(block_m: int, block_n: int) -> int:
    """Warps of a program whose accumulator is block_m x block_n float32: 8 past 4,096
    elements (64 registers a thread at 4 warps), so large tiles do not spill."""
    return 8 if block_m * block_n > 4096 else 4


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    scaling: torch.Tensor,
    seg: Segments,
) -> torch.Tensor:
    """Partial sums [splits, T, width] (float32) of scaling[slot_t] * x[t] @ a[slot_t]: x
    [T, in], a [slots, in, width] (one layer of a stack's slots, or a column slice of it).
    Rows of no slot are left unwritten."""
    tokens, in_f = x.shape
    _, _, width = a.shape
    tiles = seg.tile_slot.shape[0]
    splits = split_k(in_f, tiles, tokens, width)
    out = torch.empty((splits, tokens, width), dtype=torch.float32, device=x.device)
    block_r = _block(width)
    step = block_k(block_r)
    k_per_split = triton.cdiv(triton.cdiv(in_f, splits), step) * step
    _shrink_kernel[(tiles, splits)](
        x, a, out, scaling, seg.order, seg.tile_slot, seg.tile_start, seg.tile_end,
        in_f, width, k_per_split,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=seg.block_m, BLOCK_K=step, BLOCK_R=block_r,
        IEEE=x.dtype == torch.float32, num_warps=num_warps(seg.block_m, block_r),
    )  # fmt: skip
    return out


def lora_expand(
    shrunk: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    seg: Segments,
    widths: tuple[int, ...],
) -> None:
    """y[t, cols_j] += shrunk[:, t, j*R : (j+1)*R].sum(0) @ b[slot_t][:, cols_j], in place, for
    each projection j of the stack (`widths`: their output columns, side by side in b and y):
    shrunk from lora_shrink, b [slots, R, out] (one layer), y [T, out] (may be a column slice
    of a wider output)."""
    check_stack(b, y, widths, shrunk.shape[2])
    rank = b.shape[1]
    padded = (*widths, 0, 0)[:MAX_STACK]
    cols = block_n(seg.block_m)
    blocks = sum(triton.cdiv(w, cols) for w in widths)
    splits = shrunk.shape[0]
    _expand_kernel[(seg.tile_slot.shape[0], blocks)](
        shrunk, b, y, seg.order, seg.tile_slot, seg.tile_start, seg.tile_end,
        *padded, rank, splits,
        shrunk.stride(0), shrunk.stride(1), shrunk.stride(2),
        b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=seg.block_m, BLOCK_N=cols, BLOCK_R=_block(rank),
        SPLITS=int(triton.next_power_of_2(splits)),
        IEEE=y.dtype == torch.float32, num_warps=num_warps(seg.block_m, cols),
    )  # fmt: skip


class SegmentedLauncher:
    """A step's launches on this path (lora/segmented_step.py's StackLauncher): the tiles
    computed once for the step, shared by every layer and stack; a shrink and an expand each."""

    def __init__(self, token_slots: torch.Tensor, num_slots: int) -> None:
        self._segments = segments(token_slots, num_slots)

    def run(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
        scaling: torch.Tensor, widths: tuple[int, ...],
    ) -> None:  # fmt: skip
        """y += each row's delta of the stack (`widths`: its projections' output columns)."""
        lora_expand(lora_shrink(x, a, scaling, self._segments), b, y, self._segments, widths)
