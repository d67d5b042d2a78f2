"""The host tier's copies on CUDA run on their own stream, asynchronously, and stay ordered with
the compute stream's writes (site_engine/engine/host_kv.py): a block copied to the host after a
long-running write reads that write, a block overwritten by a later step (which waits for the
copy's event, as the scheduler's `kv_copies_wait_for_step` says) still reads back from the host
what it held when it was copied, and a copy back into another block is there for the step that
reads it.

The compute stream is kept busy with matmuls before each write and the copies are made large, so
that a missing wait shows as wrong bytes rather than passing by luck of timing.
"""

from __future__ import annotations

import pytest
import torch

from site_engine.engine.core.types import KvCopy
from site_engine.engine.host_kv import HostKvPool
from site_engine.engine.kv_cache import KVCacheSpec, PagedKVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BLOCKS = range(32)  # the blocks copied out: ~128 MiB, milliseconds over PCIe


def busy(device: torch.device) -> None:
    """Queue ~tens of ms of work on the current stream."""
    a = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        a = a @ a
        a = a / a.norm()


@pytest.mark.parametrize("repeat", range(3))
def test_a_block_offloaded_then_overwritten_reads_back_its_offloaded_content(
    cuda_device: str, repeat: int
) -> None:
    device = torch.device(cuda_device)
    cache = PagedKVCache(
        KVCacheSpec(num_layers=16, num_kv_heads=8, head_dim=128),
        num_blocks=72, block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    pool = HostKvPool(cache, num_slots=len(BLOCKS))
    first = torch.arange(len(BLOCKS), device=device, dtype=torch.float32) + 1.0 + repeat
    # Step 1: the step writes the blocks after a long computation; their copies ahead of
    # eviction are queued at the next step's start (the scheduler lists them then).
    busy(device)
    for block in BLOCKS:
        for layer in cache.layers:
            layer[:, block].fill_(first[block])
    pool.run([KvCopy(to_host=True, block=b, slot=b) for b in BLOCKS], 0, step_id=2)
    # Step 3 overwrites those blocks: it waits for step 2's copies (they may still run).
    pool.run((), 0, step_id=3, wait_for_step=2)
    for block in BLOCKS:
        for layer in cache.layers:
            layer[:, block].fill_(-1.0)
    # Step 4 reads them back into other blocks (40..71) and reads those right away.
    back = [KvCopy(to_host=False, block=40 + b, slot=b) for b in BLOCKS]
    pool.run(back, len(back), step_id=4)
    blocks = torch.stack([layer[:, 40 : 40 + len(BLOCKS)] for layer in cache.layers])
    read = blocks.amin(dim=(0, 1, 3, 4, 5))
    torch.cuda.synchronize(device)
    assert torch.equal(read, first), "a block read back what it held when copied out"
    assert torch.equal(pool.slots[:, 0, 0, 0, 0, 0], first.cpu())
    assert all(bool((layer[:, : len(BLOCKS)] == -1.0).all()) for layer in cache.layers)


def test_copies_to_the_host_do_not_hold_up_the_next_step(cuda_device: str) -> None:
    """A step that overwrites none of the blocks being copied out starts without waiting for
    them: its work is done before the copies are (they take milliseconds; its write does not)."""
    device = torch.device(cuda_device)
    cache = PagedKVCache(
        KVCacheSpec(num_layers=16, num_kv_heads=8, head_dim=128),
        num_blocks=72, block_size=16, dtype=torch.float32, device=device,
    )  # fmt: skip
    pool = HostKvPool(cache, num_slots=len(BLOCKS))
    torch.cuda.synchronize(device)
    pool.run([KvCopy(to_host=True, block=b, slot=b) for b in BLOCKS], 0, step_id=1)
    pool.run((), 0, step_id=2)  # overwrites nothing copied: no wait
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    cache.layers[-1][:, 70].fill_(7.0)
    done.record()
    done.synchronize()
    copies = pool._ahead.get(1)
    assert copies is not None
    still_copying = not copies.query()  # type: ignore[no-untyped-call]
    assert still_copying, "the step's write waited for the copies to the host"
    pool.synchronize()
