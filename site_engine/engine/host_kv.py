"""The host tier's memory (pinned on CUDA) and the copies the scheduler decides between it and the
device's paged KV cache (site_engine/engine/host_tier.py decides, this module moves bytes).

A slot holds one block of every layer, K and V: [num_layers, 2, block_size, kv_heads, head_dim],
contiguous, so one block moves in one memcpy. On CUDA the copies run on a side stream, in the
order the scheduler listed them (a slot may be written and read back in one step, a block copied
out before it is reused): the side stream first waits for the work already queued on the compute
stream (the step that wrote those blocks may still be running), and the compute stream waits
only for the copies its step needs (copies back from the host, copies of blocks it overwrites)
plus the previous step's copies ahead of eviction, which by then have overlapped a whole step.
Consecutive copies of one direction are batched: one gather (or scatter) kernel over the device
blocks and one memcpy per block to (or from) contiguous staging.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import torch

from site_engine.engine.kv_cache import PagedKVCache
from site_engine.engine.types import KvCopy


class HostKvPool:
    def __init__(self, cache: PagedKVCache, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._cache = cache
        layers, kv, _, block_size, heads, head_dim = cache.tensor.shape
        cuda = cache.device.type == "cuda"
        self.slots = torch.empty(
            (num_slots, layers, kv, block_size, heads, head_dim),
            dtype=cache.dtype,
            pin_memory=cuda,
        )
        self._stream = torch.cuda.Stream(cache.device) if cuda else None  # type: ignore[no-untyped-call]
        # Recorded after the previous step's copies: the next step's forward waits for it.
        self._previous: torch.cuda.Event | None = None

    @property
    def num_slots(self) -> int:
        return int(self.slots.shape[0])

    @property
    def bytes_per_slot(self) -> int:
        return self.slots[0].numel() * self.slots.element_size()

    def run(self, copies: Sequence[KvCopy], before_step: int) -> None:
        """Queue `copies` in order; the compute stream's next work waits for the first
        `before_step` of them and for the previous call's copies."""
        stream = self._stream
        if stream is None:
            self._copy_runs(copies)  # CPU: synchronous, in order
            return
        compute = torch.cuda.current_stream(self._cache.device)
        previous, self._previous = self._previous, None
        needed: torch.cuda.Event | None = None
        if copies:
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                if before_step:
                    self._copy_runs(copies[:before_step])
                    needed = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    needed.record(stream)
                self._copy_runs(copies[before_step:])
                self._previous = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self._previous.record(stream)
        for event in (previous, needed):
            if event is not None:
                compute.wait_event(event)

    def _copy_runs(self, copies: Sequence[KvCopy]) -> None:
        for to_host, run in groupby(copies, key=lambda copy: copy.to_host):
            batch = list(run)
            if to_host:
                self._to_host(batch)
            else:
                self._to_device(batch)

    def _block_index(self, batch: list[KvCopy]) -> torch.Tensor:
        blocks = torch.tensor([copy.block for copy in batch], dtype=torch.long)
        return blocks.to(self._cache.device, non_blocking=True)

    def _to_host(self, batch: list[KvCopy]) -> None:
        # [layers, 2, n, ...] gathered, then block-major so each block is one contiguous memcpy.
        staged = self._cache.tensor.index_select(2, self._block_index(batch))
        staged = staged.permute(2, 0, 1, 3, 4, 5).contiguous()
        for row, copy in enumerate(batch):
            self.slots[copy.slot].copy_(staged[row], non_blocking=True)

    def _to_device(self, batch: list[KvCopy]) -> None:
        staged = torch.empty(
            (len(batch), *self.slots.shape[1:]), dtype=self.slots.dtype, device=self._cache.device
        )
        for row, copy in enumerate(batch):
            staged[row].copy_(self.slots[copy.slot], non_blocking=True)
        self._cache.tensor.index_copy_(
            2, self._block_index(batch), staged.permute(1, 2, 0, 3, 4, 5)
        )
