"""A step's tokens grouped by adapter slot, as the LoRA kernels read them
(cuda/lora_segmented.py).

The tokens are sorted by slot (a counting sort of the slot indices) and each slot's run is cut
into tiles of at most `tile_rows` tokens; a kernel program takes a tile (or a piece of one).

Everything here is fixed-shape torch ops on the device from the slot-index tensor: no host
sync, so a CUDA graph captured over a static slot-index buffer replays the layout the host wrote
into that buffer. The tile count is sized for the worst case, min(T, cdiv(T, tile_rows) +
slots) (each slot in use has at most one partial tile, and a tile holds at least one token);
tiles past the real ones have slot -1.
"""

from __future__ import annotations

import torch

MAX_STACK = 3  # projections a stack may hold (q/k/v)


def check_stack(b: torch.Tensor, y: torch.Tensor, widths: tuple[int, ...], shrunk: int) -> None:
    """An expand's operands agree: `widths` (a stack's projections' output columns) fill b
    [slots, R, out] and y [T, out], and the shrink gave `shrunk` = R columns a projection."""
    _, rank, out_f = b.shape
    if not 1 <= len(widths) <= MAX_STACK or sum(widths) != out_f or y.shape[1] != out_f:
        raise ValueError(
            f"widths {widths}: the output has {y.shape[1]} columns, the adapters' B {out_f}"
        )
    if shrunk != rank * len(widths):
        raise ValueError(f"the shrink gave {shrunk} columns for {len(widths)} x {rank}")


def max_tiles(tokens: int, num_slots: int, tile_rows: int) -> int:
    """Tiles a step of `tokens` can need: each slot in use has a partial tile at most, and a
    tile holds at least one token."""
    return min(tokens, -(-tokens // tile_rows) + num_slots)


def sorted_by_slot(
    token_slots: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token indices sorted by slot (base rows first), each slot's first position in that
    order and its token count. A counting sort (one-hot prefix sums, then a scatter) rather than
    torch.sort: fixed shapes and plain kernels, nothing that could sync with the host inside a
    graph capture."""
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
    return order, starts_all[1:], counts_all[1:]


def slot_tiles(
    starts: torch.Tensor, counts: torch.Tensor, tile_rows: int, tiles: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each slot's run cut into tiles of `tile_rows`, `tiles` of them (the worst case): each
    tile's slot (-1 past the real tiles), its first position in the order and the end of its
    slot's run."""
    num_slots = starts.shape[0]
    per_slot = (counts + tile_rows - 1) // tile_rows
    tiles_end = torch.cumsum(per_slot, 0, dtype=torch.int32)
    index = torch.arange(tiles, dtype=torch.int32, device=starts.device)
    slot_of = torch.searchsorted(tiles_end, index, right=True).to(torch.int32)
    valid = slot_of < num_slots
    slot = slot_of.clamp(max=num_slots - 1)
    first_tile = tiles_end[slot] - per_slot[slot]
    tile_start = starts[slot] + (index - first_tile) * tile_rows
    tile_slot = torch.where(valid, slot, torch.full_like(slot, -1))
    return tile_slot, tile_start, starts[slot] + counts[slot]
