"""Segmented LoRA kernels (Punica/S-LoRA style): each row's delta through its own adapter only.

The CPU path (lora/slots.py) multiplies every row by every slot's A and B and zeroes the other
slots' part: `slots` times the work, and at 64 slots on a GPU it would read every adapter for
every row. Here a step's tokens are grouped by slot (a counting sort of the slot indices) and cut
into tiles of BLOCK_M tokens of one slot; a program takes one tile:

    shrink  s[t, :]  = scaling[slot] * x[t, :] @ A[slot]       ([in] @ [in, r] -> [r])
    expand  y[t, n] += s[t, :] @ B[slot][:, n]                 ([r] @ [r, out])

so each tile reads its slot's A and B once. A slot index of -1 (a base row, or graph padding)
belongs to no tile: its row is untouched.

Everything that depends on which rows use which slot is computed on the device by fixed-shape
torch ops from the slot-index tensor (`segments`): no host sync, so a CUDA graph captured over a
static slot-index buffer replays a step's layout that the host wrote into that buffer. The grid
is sized for the worst case (every slot's last tile partial: cdiv(T, BLOCK_M) + slots tiles);
programs past the real tiles return at once.

The shrink splits the input features over SPLIT_K programs (a decode step of 64 adapters has
few tiles and a long reduction); each writes its partial sums to its own plane of a float32
buffer and the expand adds the planes: no atomics, so a step's result does not depend on the
order programs ran in (graphs and eager runs agree bit for bit).

The slot tensors keep lora/slots.py's layout (A [in, slots, r], B [slots, r, out] per layer);
ranks are zero-padded to the site's max rank, so mixed ranks cost the padded rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per tile: tl.dot's smallest M
_BLOCK_K = 64
_BLOCK_N = 64


@dataclass(frozen=True, slots=True)
class Segments:
    """A step's tokens grouped by slot, as device tensors of fixed shapes (graph-safe)."""

    order: torch.Tensor  # [T] int32: token indices sorted by slot (base rows first)
    tile_slot: torch.Tensor  # [tiles] int32: a tile's slot, -1 past the real tiles
    tile_start: torch.Tensor  # [tiles] int32: its first position in `order`
    tile_end: torch.Tensor  # [tiles] int32: the end of its slot's run in `order`


def segments(token_slots: torch.Tensor, num_slots: int) -> Segments:
    """The tiles of a step whose token t uses slot token_slots[t] (-1: none). A counting sort
    (one-hot prefix sums, then a scatter) rather than torch.sort: fixed shapes and plain kernels,
    nothing that could sync with the host inside a graph capture."""
    device = token_slots.device
    tokens = token_slots.shape[0]
    column = (token_slots.long() + 1).unsqueeze(1)  # 0: no adapter, s + 1: slot s
    one_hot = torch.zeros((tokens, num_slots + 1), dtype=torch.int32, device=device)
    one_hot.scatter_(1, column, 1)
    counts_all = one_hot.sum(0, dtype=torch.int32)
    starts_all = torch.cumsum(counts_all, 0, dtype=torch.int32) - counts_all
    # A token's place in `order`: its slot's start plus how many of its slot's tokens precede it.
    before = torch.cumsum(one_hot, 0, dtype=torch.int32).gather(1, column).squeeze(1) - 1
    place = (starts_all.gather(0, column.squeeze(1)) + before).long()
    order = torch.empty(tokens, dtype=torch.int32, device=device)
    order.scatter_(0, place, torch.arange(tokens, dtype=torch.int32, device=device))
    starts, counts = starts_all[1:], counts_all[1:]
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = torch.cumsum(tiles, 0, dtype=torch.int32)
    index = torch.arange(-(-tokens // BLOCK_M) + num_slots, dtype=torch.int32, device=device)
    slot_of = torch.searchsorted(tiles_end, index, right=True).to(torch.int32)
    valid = slot_of < num_slots
    slot = slot_of.clamp(max=num_slots - 1)
    first_tile = tiles_end[slot] - tiles[slot]
    tile_start = starts[slot] + (index - first_tile) * BLOCK_M
    tile_end = starts[slot] + counts[slot]
    neg = torch.full_like(slot, -1)
    return Segments(order, torch.where(valid, slot, neg), tile_start, tile_end)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, scaling_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    k_total, R, k_per_split,
    sx_t, sx_k, sa_k, sa_s, sa_r, so_split, so_t, so_r,
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
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_begin = split * k_per_split
    a_slot = a_ptr + slot.to(tl.int64) * sa_s
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = (offs_k < k_total) & (offs_k < k_begin + k_per_split)
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
    N, R, splits,
    ss_split, ss_t, ss_r, sb_s, sb_r, sb_n, sy_t, sy_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    rows = start + tl.arange(0, BLOCK_M)
    mask_m = rows < end
    tok = tl.load(order_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    mask_s = mask_m[:, None] & mask_r[None, :]
    shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in range(splits):
        s = s_ptr + split * ss_split + tok[:, None] * ss_t + offs_r[None, :] * ss_r
        shrunk += tl.load(s, mask=mask_s, other=0.0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    b = tl.load(
        b_ptr + slot.to(tl.int64) * sb_s + offs_r[:, None] * sb_r + offs_n[None, :] * sb_n,
        mask=mask_r[:, None] & mask_n[None, :],
        other=0.0,
    )
    # The delta in the weights' dtype, as the PyTorch path rounds it; accumulated in float32.
    if IEEE:
        delta = tl.dot(shrunk.to(b.dtype), b, input_precision="ieee")
    else:
        delta = tl.dot(shrunk.to(b.dtype), b)
    y_rows = y_ptr + tok[:, None] * sy_t + offs_n[None, :] * sy_n
    mask_y = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_rows, mask=mask_y, other=0.0)
    tl.store(y_rows, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_y)


def _block_r(rank: int) -> int:
    return max(16, int(triton.next_power_of_2(rank)))


def split_k(in_features: int) -> int:
    """Programs the shrink splits the input features over: ~1,024 features each, at most 8."""
    return max(1, min(8, in_features // 1024))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    scaling: torch.Tensor,
    seg: Segments,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Partial sums [splits, T, r] (float32) of scaling[slot_t] * x[t] @ a[:, slot_t]: x [T, in],
    a [in, slots, r] (one layer of the stacked slots). Rows of no slot are left unwritten."""
    tokens, in_f = x.shape
    _, _, rank = a.shape
    splits = split_k(in_f)
    if out is None:
        out = torch.empty((splits, tokens, rank), dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(in_f, splits), _BLOCK_K) * _BLOCK_K
    grid = (seg.tile_slot.shape[0], splits)
    _shrink_kernel[grid](
        x, a, out, scaling, seg.order, seg.tile_slot, seg.tile_start, seg.tile_end,
        in_f, rank, k_per_split,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=BLOCK_M, BLOCK_K=_BLOCK_K, BLOCK_R=_block_r(rank),
        IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out


def lora_expand(shrunk: torch.Tensor, b: torch.Tensor, y: torch.Tensor, seg: Segments) -> None:
    """y[t] += shrunk[:, t].sum(0) @ b[slot_t], in place: shrunk from lora_shrink, b
    [slots, r, out] (one layer), y [T, out] (may be a column slice of a wider output)."""
    _, rank, out_f = b.shape
    if y.shape[1] != out_f:
        raise ValueError(f"the output has {y.shape[1]} columns, the adapter's B {out_f}")
    grid = (seg.tile_slot.shape[0], triton.cdiv(out_f, _BLOCK_N))
    _expand_kernel[grid](
        shrunk, b, y, seg.order, seg.tile_slot, seg.tile_start, seg.tile_end,
        out_f, rank, shrunk.shape[0],
        shrunk.stride(0), shrunk.stride(1), shrunk.stride(2),
        b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_R=_block_r(rank),
        IEEE=y.dtype == torch.float32,
    )  # fmt: skip


class SegmentedLoraStep:
    """A step's LoRA deltas through the segmented kernels: lora/slots.py's LoraStep on CUDA."""

    def __init__(
        self,
        a: dict[str, torch.Tensor],
        b: dict[str, torch.Tensor],
        scaling: torch.Tensor,
        token_slots: torch.Tensor,
    ) -> None:
        self._a, self._b, self._scaling = a, b, scaling
        num_slots = scaling.shape[0]
        # Once per step, shared by every layer and projection.
        self._segments = segments(token_slots, num_slots)

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's delta of `proj` in `layer` (y may be a column slice of a fused
        projection's output)."""
        a = self._a.get(proj)
        if a is None:
            return  # no adapter in a slot targets this projection
        shrunk = lora_shrink(x, a[layer], self._scaling, self._segments)
        lora_expand(shrunk, self._b[proj][layer], y, self._segments)

    def project(
        self, layer: int, proj: str, module: torch.nn.Module, x: torch.Tensor
    ) -> torch.Tensor:
        """module(x) (the base GEMM, once for all rows) plus each row's delta."""
        y: torch.Tensor = module(x)
        self.add(layer, proj, x, y)
        return y
