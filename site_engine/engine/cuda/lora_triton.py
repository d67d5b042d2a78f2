"""The multi-LoRA Triton kernel: a stack's shrink and expand tasks in one grid (or either half
alone), for cuda/lora_kernels.py, which plans and launches it and whose docstring says how it
works.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Polls of a tile's counter before an expand task gives up (~0.5 s).
_MAX_SPINS = tl.constexpr(1 << 20)

# Masks and offsets below are written so that Triton can prove the contiguous dimension's
# loads and stores aligned and unmasked in runs of 16 bytes (vectorized): the widths, the rank
# and "whole blocks" (EVEN_K, EVEN_N) are kernel constants, and offsets along that dimension are
# a block's start plus tl.arange. A mask on a run-time bound there makes every element its own
# scalar load with its own 64-bit address (the first kernels did that: 168-255 registers a
# thread, two programs an SM). No tl.zeros or tl.cdiv either: they are @jit functions of
# Triton's own, which a CPU test process that imported triton before turning the interpreter on
# could not run (devtools/triton_interpreter.py).


@triton.jit
def _shrink_task(
    x_ptr, a_ptr, part_ptr, scaling_ptr, order_ptr, slot, start, end, split, k_total,
    k_per_split, sx_t, sa_s, sa_k, sp_split, sp_t,
    WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Partial sums of one split of the input features for one tile's rows (chunk by chunk:
    a tile of more than one chunk re-reads its A block from L2, not memory)."""
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < WIDTH
    k_begin = split * k_per_split
    k_stop = tl.minimum(k_begin + k_per_split, k_total)
    a_slot = a_ptr + slot.to(tl.int64) * sa_s
    scale = tl.load(scaling_ptr + slot).to(tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask_m = rows < end
        tok = tl.load(order_ptr + rows, mask=mask_m, other=0).to(tl.int64)
        x_rows = x_ptr + tok[:, None] * sx_t
        acc = tl.full((BLOCK_M, BLOCK_W), 0.0, dtype=tl.float32)
        for k0 in range(k_begin, k_stop, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a_block = a_slot + offs_k[:, None].to(tl.int64) * sa_k + offs_w[None, :]
            # A and B are read once a step: first out of L2, so the activations the base GEMM
            # just touched (x here, y in the expand) are still there.
            if EVEN_K:
                a = tl.load(a_block, mask=mask_w[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            else:
                mask_k = offs_k < k_stop
                a = tl.load(a_block, mask=mask_k[:, None] & mask_w[None, :], other=0.0,
                            eviction_policy="evict_first")  # fmt: skip
                x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                            other=0.0)  # fmt: skip
            if IEEE:
                acc += tl.dot(x, a, input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        out = part_ptr + split * sp_split + tok[:, None] * sp_t + offs_w[None, :]
        tl.store(out, acc * scale, mask=mask_m[:, None] & mask_w[None, :])


@triton.jit
def _expand_task(
    part_ptr, b_ptr, y_ptr, order_ptr, sync_ptr, tile, slot, start, end, pid_n, splits,
    sp_split, sp_t, sb_s, sb_r, sy_t,
    WIDTH0: tl.constexpr, WIDTH1: tl.constexpr, WIDTH2: tl.constexpr, RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLITS: tl.constexpr, EVEN_N: tl.constexpr, WAIT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """y += one tile's rows' deltas in one block of output columns (B read once per tile)."""
    # Which projection of the stack these columns belong to (a block never straddles two:
    # each projection's columns start a block of their own; with EVEN_N every width is whole
    # blocks, so block pid_n starts at column pid_n * BLOCK_N).
    blocks0: tl.constexpr = (WIDTH0 + BLOCK_N - 1) // BLOCK_N
    blocks1: tl.constexpr = (WIDTH1 + BLOCK_N - 1) // BLOCK_N
    in1 = pid_n >= blocks0
    in2 = pid_n >= blocks0 + blocks1
    part = in1.to(tl.int32) + in2.to(tl.int32)
    if EVEN_N:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = cols < WIDTH0 + WIDTH1 + WIDTH2  # all true: only a shape for the masks below
    else:
        first_col = tl.where(in2, WIDTH0 + WIDTH1, tl.where(in1, WIDTH0, 0))
        width = tl.where(in2, WIDTH2, tl.where(in1, WIDTH1, WIDTH0))
        first_block = tl.where(in2, blocks0 + blocks1, tl.where(in1, blocks0, 0))
        offs_local = (pid_n - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_local < width
        cols = first_col + offs_local
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    # B first: it depends on nothing the shrink writes, so it is in flight during the wait.
    b_block = b_ptr + slot.to(tl.int64) * sb_s + offs_r[:, None] * sb_r + cols[None, :]
    if EVEN_N:
        b = tl.load(b_block, mask=mask_r[:, None], other=0.0, eviction_policy="evict_first")
    else:
        b = tl.load(b_block, mask=mask_r[:, None] & mask_n[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
    poison = 0.0
    if WAIT:
        # sync: [ticket, failed, done per tile]. A program that gives up raises `failed`, and
        # every other waiter of the launch gives up at once instead of spinning its own bound.
        done_ptr = sync_ptr + 2 + tile
        seen = tl.load(done_ptr, volatile=True)
        failed = tl.load(sync_ptr + 1, volatile=True)
        spins = 0
        while (seen < splits) & (failed == 0) & (spins < _MAX_SPINS):
            seen = tl.load(done_ptr, volatile=True)
            failed = tl.load(sync_ptr + 1, volatile=True)
            spins += 1
        # Acquire: the partial sums the splits released are visible to this program's loads.
        seen = tl.atomic_add(done_ptr, 0, sem="acquire")
        tl.debug_barrier()
        if seen < splits:
            tl.atomic_add(sync_ptr + 1, 1, sem="relaxed")
        poison = tl.where(seen < splits, float("nan"), 0.0)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask_m = rows < end
        tok = tl.load(order_ptr + rows, mask=mask_m, other=0).to(tl.int64)
        mask_s = mask_m[:, None] & mask_r[None, :]
        s_rows = part_ptr + tok[:, None] * sp_t + (part * RANK + offs_r)[None, :]
        shrunk = tl.full((BLOCK_M, BLOCK_R), 0.0, dtype=tl.float32) + poison
        # Unrolled (SPLITS >= splits, a power of two): every plane's load in flight at once.
        for split in tl.static_range(SPLITS):
            shrunk += tl.load(s_rows + split * sp_split, mask=mask_s & (split < splits),
                              other=0.0, cache_modifier=".cg")  # fmt: skip
        # The delta in the weights' dtype, as the PyTorch path rounds it; accumulated in float32.
        if IEEE:
            delta = tl.dot(shrunk.to(b.dtype), b, input_precision="ieee")
        else:
            delta = tl.dot(shrunk.to(b.dtype), b)
        y_rows = y_ptr + tok[:, None] * sy_t + cols[None, :]
        mask_y = mask_m[:, None] if EVEN_N else mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_rows, mask=mask_y, other=0.0)
        tl.store(y_rows, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_y)


@triton.jit
def _tile_of(task, per_tile, tile_slot_ptr, tile_start_ptr, tile_end_ptr):
    """A task's tile (`per_tile` tasks a tile): its index, slot (-1: none), and rows."""
    tile = task // per_tile
    slot = tl.load(tile_slot_ptr + tile)
    return tile, slot, tl.load(tile_start_ptr + tile), tl.load(tile_end_ptr + tile)


@triton.jit
def _shrink_tile(
    task, x_ptr, a_ptr, part_ptr, scaling_ptr, order_ptr, tile_slot_ptr, tile_start_ptr,
    tile_end_ptr, sync_ptr, k_total, k_per_split, splits, sx_t, sa_s, sa_k, sp_split, sp_t,
    SIGNAL: tl.constexpr, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    tile, slot, start, end = _tile_of(task, splits, tile_slot_ptr, tile_start_ptr, tile_end_ptr)
    if slot >= 0:
        _shrink_task(
            x_ptr, a_ptr, part_ptr, scaling_ptr, order_ptr, slot, start, end,
            task - tile * splits, k_total, k_per_split, sx_t, sa_s, sa_k, sp_split, sp_t,
            WIDTH, BLOCK_M, BLOCK_K, BLOCK_W, EVEN_K, IEEE,
        )  # fmt: skip
        if SIGNAL:
            tl.debug_barrier()  # every thread's partial sums stored before the release
            tl.atomic_add(sync_ptr + 2 + tile, 1, sem="release")


@triton.jit
def _expand_tile(
    task, part_ptr, b_ptr, y_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    sync_ptr, n_blocks, splits, sp_split, sp_t, sb_s, sb_r, sy_t,
    WIDTH0: tl.constexpr, WIDTH1: tl.constexpr, WIDTH2: tl.constexpr, RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLITS: tl.constexpr, EVEN_N: tl.constexpr, WAIT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    tile, slot, start, end = _tile_of(task, n_blocks, tile_slot_ptr, tile_start_ptr, tile_end_ptr)
    if slot >= 0:
        _expand_task(
            part_ptr, b_ptr, y_ptr, order_ptr, sync_ptr, tile, slot, start, end,
            task - tile * n_blocks, splits, sp_split, sp_t, sb_s, sb_r, sy_t,
            WIDTH0, WIDTH1, WIDTH2, RANK, BLOCK_M, BLOCK_N, BLOCK_R, SPLITS, EVEN_N, WAIT, IEEE,
        )  # fmt: skip


@triton.jit
def _lora_delta_kernel(
    x_ptr, a_ptr, part_ptr, b_ptr, y_ptr, scaling_ptr,
    order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, sync_ptr,
    k_total, k_per_split, splits, n_blocks, tiles,
    sx_t, sa_s, sa_k, sp_split, sp_t, sb_s, sb_r, sy_t,
    PHASE: tl.constexpr, WIDTH: tl.constexpr, WIDTH0: tl.constexpr, WIDTH1: tl.constexpr,
    WIDTH2: tl.constexpr, RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """x, a, part, b and y with unit stride along their last dimension (the launcher checks)."""
    n_shrink = tiles * splits
    if PHASE == 1:  # SHRINK alone
        _shrink_tile(
            tl.program_id(0), x_ptr, a_ptr, part_ptr, scaling_ptr, order_ptr, tile_slot_ptr,
            tile_start_ptr, tile_end_ptr, sync_ptr, k_total, k_per_split, splits,
            sx_t, sa_s, sa_k, sp_split, sp_t,
            False, WIDTH, BLOCK_M, BLOCK_K, BLOCK_W, EVEN_K, IEEE,
        )  # fmt: skip
    elif PHASE == 2:  # EXPAND alone
        _expand_tile(
            tl.program_id(0), part_ptr, b_ptr, y_ptr, order_ptr, tile_slot_ptr, tile_start_ptr,
            tile_end_ptr, sync_ptr, n_blocks, splits, sp_split, sp_t, sb_s, sb_r, sy_t,
            WIDTH0, WIDTH1, WIDTH2, RANK, BLOCK_M, BLOCK_N, BLOCK_R, SPLITS, EVEN_N, False, IEEE,
        )  # fmt: skip
    else:  # FUSED: tasks in the order programs start (the module's docstring)
        task = tl.atomic_add(sync_ptr, 1, sem="relaxed")
        if task < n_shrink:
            _shrink_tile(
                task, x_ptr, a_ptr, part_ptr, scaling_ptr, order_ptr, tile_slot_ptr,
                tile_start_ptr, tile_end_ptr, sync_ptr, k_total, k_per_split, splits,
                sx_t, sa_s, sa_k, sp_split, sp_t,
                True, WIDTH, BLOCK_M, BLOCK_K, BLOCK_W, EVEN_K, IEEE,
            )  # fmt: skip
        else:
            _expand_tile(
                task - n_shrink, part_ptr, b_ptr, y_ptr, order_ptr, tile_slot_ptr,
                tile_start_ptr, tile_end_ptr, sync_ptr, n_blocks, splits, sp_split, sp_t,
                sb_s, sb_r, sy_t, WIDTH0, WIDTH1, WIDTH2, RANK, BLOCK_M, BLOCK_N, BLOCK_R,
                SPLITS, EVEN_N, True, IEEE,
            )  # fmt: skip
