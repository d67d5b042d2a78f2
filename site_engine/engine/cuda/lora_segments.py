"""A step's tokens grouped by adapter slot, as the LoRA kernels read them (cuda/lora_kernels.py).

The tokens are sorted by slot (a counting sort of the slot indices) and each slot's run is cut
into tiles of at most `tile_rows` tokens; a kernel program takes one tile and walks its rows in
chunks of `block_m` (the tensor-core product's M). A tile holds a whole slot run whenever the
run fits (decode steps: 64 rows; prefill-sized steps: 256), so a slot's A and B are read from
memory once per tile, i.e. once a step for a decode step's slots.

Everything here is fixed-shape torch ops on the device from the slot-index tensor: no host
sync, so a CUDA graph captured over a static slot-index buffer replays the layout the host wrote
into that buffer. The tile count is sized for the worst case, min(T, cdiv(T, tile_rows) +
slots) (each slot in use has at most one partial tile, and a tile holds at least one token);
tiles past the real ones have slot -1 and their programs return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows per chunk: tl.dot's smallest M for decode-sized steps, where a slot has a few rows; 64
# for prefill-sized ones (a wider tensor-core product, the weights reused over more rows).
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
PREFILL_TOKENS = 512  # steps of more tokens than this use the prefill sizes
CHUNKS_PER_TILE = 4  # a tile: up to 4 chunks of one slot (64 rows decode, 256 prefill)


@dataclass(frozen=True, slots=True)
class Segments:
    """A step's tokens grouped by slot, as device tensors of fixed shapes (graph-safe)."""

    block_m: int  # rows per chunk (a kernel constant)
    tile_rows: int  # rows per tile at most (a multiple of block_m)
    order: torch.Tensor  # [T] int32: token indices sorted by slot (base rows first)
    tile_slot: torch.Tensor  # [tiles] int32: a tile's slot, -1 past the real tiles
    tile_start: torch.Tensor  # [tiles] int32: its first position in `order`
    tile_end: torch.Tensor  # [tiles] int32: one past its last position in `order`

    @property
    def tiles(self) -> int:
        return int(self.tile_slot.shape[0])


def chunk_rows(tokens: int) -> int:
    """Rows per chunk for a step of `tokens` (a graph's bucket: fixed per graph)."""
    return DECODE_BLOCK_M if tokens <= PREFILL_TOKENS else PREFILL_BLOCK_M


def max_tiles(tokens: int, num_slots: int, tile_rows: int) -> int:
    """Tiles a step of `tokens` can need: each slot in use has a partial tile at most, and a
    tile holds at least one token."""
    return min(tokens, -(-tokens // tile_rows) + num_slots)


def segments(
    token_slots: torch.Tensor,
    num_slots: int,
    block_m: int | None = None,
    tile_rows: int | None = None,
) -> Segments:
    """The tiles of a step whose token t uses slot token_slots[t] (-1: none): chunks of
    `block_m` rows (default: chunk_rows), tiles of `tile_rows` (default: CHUNKS_PER_TILE
    chunks). Fixed shapes and plain kernels (sorted_by_slot), nothing that could sync with the
    host inside a capture."""
    tokens = token_slots.shape[0]
    block_m = chunk_rows(tokens) if block_m is None else block_m
    tile_rows = CHUNKS_PER_TILE * block_m if tile_rows is None else tile_rows
    if tile_rows % block_m or tile_rows <= 0:
        raise ValueError(f"tile_rows {tile_rows} is not a positive multiple of {block_m}")
    order, starts, counts = sorted_by_slot(token_slots, num_slots)
    tiles = max_tiles(tokens, num_slots, tile_rows)
    tile_slot, tile_start, slot_end = slot_tiles(starts, counts, tile_rows, tiles)
    tile_end = torch.minimum(tile_start + tile_rows, slot_end)
    return Segments(block_m, tile_rows, order, tile_slot, tile_start, tile_end)


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
    tile's slot (-1 past the real tiles), its first position in the order, and the end of its
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
