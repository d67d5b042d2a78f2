"""The host tier's memory (pinned on CUDA) and the copies the scheduler decides between it and the
device's paged KV cache (site_engine/engine/core/host_tier.py decides, this module moves bytes).

A slot holds one block of every layer, K and V: [num_layers, 2, block_size, kv_heads, head_dim],
contiguous, so one block moves in one memcpy. On CUDA the copies run on a side stream,
asynchronously, in the order the scheduler listed them (a slot may be written and read back in
one step): the side stream first waits for the work already queued on the compute stream (a
block's last write may still be running; the copy must read it after), and the compute stream
waits only for what its step needs: the copies back from the host it reads, and, when it
overwrites a block copied ahead of its eviction, that copy's event, only if the copy has not
finished yet. Copies to the host otherwise overlap the steps and never hold one up (issue 50).
Consecutive copies of one direction are batched: one gather (or scatter) kernel per layer over the
device blocks (the cache is one tensor per layer: kv_cache.py) and one memcpy per block to (or
from) contiguous staging.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import torch

from site_engine.engine.core.types import KvCopy
from site_engine.engine.kv_cache import PagedKVCache


class HostKvPool:
    def __init__(self, cache: PagedKVCache, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self._cache = cache
        spec = cache.spec
        cuda = cache.device.type == "cuda"
        self.slots = torch.empty(
            (num_slots, spec.num_layers, 2, cache.block_size, spec.num_kv_heads, spec.head_dim),
            dtype=cache.dtype,
            pin_memory=cuda,
        )
        self._stream = torch.cuda.Stream(cache.device) if cuda else None  # type: ignore[no-untyped-call]
        # Step id -> the event recorded after that step's copies ahead of eviction, oldest
        # first; dropped once complete (a later step overwriting one of those blocks waits on
        # it only while it is not).
        self._ahead: dict[int, torch.cuda.Event] = {}

    @property
    def num_slots(self) -> int:
        return int(self.slots.shape[0])

    @property
    def bytes_per_slot(self) -> int:
        return self.slots[0].numel() * self.slots.element_size()

    def run(
        self, copies: Sequence[KvCopy], before_step: int, step_id: int = 0, wait_for_step: int = 0
    ) -> None:
        """Queue step `step_id`'s `copies` in order; the compute stream's next work waits for
        the first `before_step` of them and, if still running, for step `wait_for_step`'s."""
        stream = self._stream
        if stream is None:
            self._copy_runs(copies)  # CPU: synchronous, in order
            return
        compute = torch.cuda.current_stream(self._cache.device)
        self._forget_done()
        pending = self._ahead.get(wait_for_step) if wait_for_step else None
        if pending is not None:
            compute.wait_event(pending)
        if not copies:
            return
        if self._ahead and step_id <= next(reversed(self._ahead)):
            # Step ids started over (a new scheduler on this runner): old events would be
            # mistaken for new steps' ones, so they must be done before they are forgotten.
            stream.synchronize()
            self._ahead.clear()
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            if before_step:
                self._copy_runs(copies[:before_step])
                needed = torch.cuda.Event()  # type: ignore[no-untyped-call]
                needed.record(stream)
                compute.wait_event(needed)
            if len(copies) > before_step:
                self._copy_runs(copies[before_step:])
                ahead = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ahead.record(stream)
                self._ahead[step_id] = ahead

    def _forget_done(self) -> None:
        ahead = self._ahead
        while ahead:
            step_id, event = next(iter(ahead.items()))
            if not event.query():  # type: ignore[no-untyped-call]
                break
            del ahead[step_id]

    def synchronize(self) -> None:
        """Wait (on the host) for every queued copy: tests read the slots after it."""
        if self._stream is not None:
            self._stream.synchronize()
            self._ahead.clear()

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
        staged = self._cache.gather(self._block_index(batch))
        staged = staged.permute(2, 0, 1, 3, 4, 5).contiguous()
        for row, copy in enumerate(batch):
            self.slots[copy.slot].copy_(staged[row], non_blocking=True)

    def _to_device(self, batch: list[KvCopy]) -> None:
        staged = torch.empty(
            (len(batch), *self.slots.shape[1:]), dtype=self.slots.dtype, device=self._cache.device
        )
        for row, copy in enumerate(batch):
            staged[row].copy_(self.slots[copy.slot], non_blocking=True)
        self._cache.scatter(self._block_index(batch), staged.permute(1, 2, 0, 3, 4, 5))
