"""A step's tokens grouped by adapter slot, as the LoRA kernels read them
(cuda/lora_segmented.py).

The tokens are sorted by slot (a counting sort of the slot indices), base rows first, and each
run (the base rows', then each slot's) is cut into tiles of at most `tile_rows` tokens; a kernel
program takes a tile (or a piece of one). The shrink and expand skip the base rows' tiles; the
kernel that adds gate/up's deltas where the activation reads them (lora_silu_mul) takes them too,
since it writes every row's activation.

Everything here is fixed-shape torch ops on the device from the slot-index tensor: no host
sync, so a CUDA graph captured over a static slot-index buffer replays the layout the host wrote
into that buffer. The tile count is sized for the worst case, min(T, cdiv(T, tile_rows) +
slots + 1) (each run has at most one partial tile, and a tile holds at least one token). A
tile's slot: -1 for the base rows' tiles, PAST for the tiles past the real ones.
"""

from __future__ import annotations

import torch

MAX_STACK = 3  # projections a stack may hold (q/k/v)
PAST = -2  # the slot of a tile past the step's real ones


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
    """Tiles a step of `tokens` can need: each run (the base rows' and each slot's) has a
    partial tile at most, and a tile holds at least one token."""
    return min(tokens, -(-tokens // tile_rows) + num_slots + 1)


def sorted_by_slot(
    token_slots: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token indices sorted by slot, and each run's first position in that order and its
    token count: run 0 the base rows (slot -1), run s + 1 slot s. A counting sort (one-hot
    prefix sums, then a scatter) rather than torch.sort: fixed shapes and plain kernels,
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
    return order, starts_all, counts_all


def slot_tiles(
    starts: torch.Tensor, counts: torch.Tensor, tile_rows: int, tiles: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each run (sorted_by_slot's) cut into tiles of `tile_rows`, `tiles` of them (the worst
    case): each tile's slot (-1: the base rows', PAST: past the real tiles), its first position
    in the order and the end of its run."""
    runs = starts.shape[0]
    per_run = (counts + tile_rows - 1) // tile_rows
    tiles_end = torch.cumsum(per_run, 0, dtype=torch.int32)
    index = torch.arange(tiles, dtype=torch.int32, device=starts.device)
    run_of = torch.searchsorted(tiles_end, index, right=True).to(torch.int32)
    valid = run_of < runs
    run = run_of.clamp(max=runs - 1)
    first_tile = tiles_end[run] - per_run[run]
    tile_start = starts[run] + (index - first_tile) * tile_rows
    tile_slot = torch.where(valid, run - 1, torch.full_like(run, PAST))
    return tile_slot, tile_start, starts[run] + counts[run]
