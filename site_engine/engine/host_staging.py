"""A step's small host-to-device copies (sampling parameters, logit-processing indices, grammar
masks) through pinned buffers that are reused step after step.

Such values must reach the device without waiting for the work queued there: with async
scheduling the model's forward is still running when the sampler prepares them, and a copy from
ordinary (pageable) memory can wait for it, or, through `torch.tensor(..., device=cuda)`, waits
for the whole stream, leaving the device idle while the host schedules the next step. Pinning a
fresh buffer per copy allocates every time: sampling a step of 256 rows, 128 of them
constrained, took 1.66 ms of host time besides filling the masks with `pin_memory()` per copy,
0.69 ms with these rings, on the H100 machine (bench/results/gpu_sessions/gpu_runs_2026-11-25.md).
So each kind of value keeps a small ring of pinned buffers, grown when a step needs more; a buffer
is refilled only after the copy out of it has run (an event per buffer).
"""

from __future__ import annotations

import numpy as np
import torch

_RING = 3  # buffers per kind: the host runs at most one step ahead of the device


class HostStaging:
    """Pinned staging for one device; on the CPU, values become tensors as they are."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rings: dict[str, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._turn: dict[str, int] = {}

    def host_buffer(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
        """A writable host array for the next `to_device(kind)`: pinned memory on CUDA, whose
        last copy to the device has run."""
        if self.device.type != "cuda":
            return np.empty(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype)
        ring = self._rings.setdefault(kind, [])
        turn = self._turn.get(kind, 0)
        size = int(np.prod(shape))
        if turn >= len(ring):
            ring.append((torch.empty(0, dtype=dtype), None))
        buffer, copied = ring[turn]
        if copied is not None:
            copied.synchronize()
        if buffer.numel() < size or buffer.dtype != dtype:
            buffer = torch.empty(max(size, 2 * buffer.numel()), dtype=dtype, pin_memory=True)
        ring[turn] = (buffer, None)
        return buffer[:size].view(shape).numpy()

    def to_device(self, kind: str, array: np.ndarray) -> torch.Tensor:
        """`array` on the device; on CUDA `array` must be the last `host_buffer(kind)`."""
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host
        turn = self._turn.get(kind, 0)
        buffer, _ = self._rings[kind][turn]
        if host.data_ptr() != buffer.data_ptr():
            raise ValueError(f"{kind}: copy from the buffer host_buffer gave, not another array")
        on_device = host.to(self.device, non_blocking=True)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record()
        self._rings[kind][turn] = (buffer, copied)
        self._turn[kind] = (turn + 1) % _RING
        return on_device

    def values(self, kind: str, values: object, dtype: torch.dtype) -> torch.Tensor:
        """A list of numbers (or a 2-D array) as a tensor on the device, through `kind`'s ring."""
        array = np.asarray(values)
        out = self.host_buffer(kind, array.shape, dtype)
        out[...] = array
        return self.to_device(kind, out)
