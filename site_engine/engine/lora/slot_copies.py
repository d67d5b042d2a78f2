"""Where an adapter's weights are written into its slot on CUDA (lora/slots.py): a stream of
their own, so that the host-to-device copy of an adapter the next step needs overlaps the step
still running instead of queueing behind it on the compute stream (issue 59).

Two orders must hold. The step that uses the slot must read it after the copy: the compute
stream waits for the copy's event before anything queued after it. And the copy must not
overwrite a slot a queued step still reads (the least recently used adapter's, evicted; with
async scheduling its last step may still run): the copy waits for the event marking the end
of the last step that read that slot. Those events cost no hook in the runner: a step reads
only the slots `LoraSlots.assign` gave it, and its reads are queued on the compute stream after
that call. So an event recorded on the compute stream when a write is about to be queued comes
after every read of every slot assigned until then; it becomes the mark of each slot assigned
since the last such event (a step may call `assign` more than once before its forward: those
calls write nothing, so they record nothing either). A slot no running step reads is written
at once.

The host side is pinned (lora/adapter.py), so the copies are DMA and the host thread queues
them without waiting; the caching host allocator keeps a pinned buffer until the copies that
read it are done, even if its adapter leaves host memory meanwhile. On CPU nothing of this
exists: the slots are written in place, synchronously, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


class SlotCopies:
    """The side stream and the events that order slot writes against the steps' reads."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # Slot -> an event on the compute stream after every read of it queued so far.
        self._read_until: dict[int, torch.cuda.Event] = {}
        self._read_since: set[int] = set()  # slots assigned since the last mark

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self._device)

    def _mark(self) -> None:
        """Before a write: every read of the slots assigned since the last mark is queued on
        the compute stream by now (never at a mere `assign`, which may come before the reads
        of its own step)."""
        if not self._read_since:
            return
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._compute())
        for slot in self._read_since:
            self._read_until[slot] = event
        self._read_since.clear()

    def assigned(self, slots: Iterable[int]) -> None:
        """The slots a step being planned reads (after its writes are queued): they stay
        'read since the last mark' until the next write marks them."""
        self._read_since.update(slots)

    @contextmanager
    def writing(self, slot: int, after_compute: bool) -> Iterator[None]:
        """Queue the writes made inside on the side stream, after the last read of `slot`
        (`after_compute`: after all the compute stream's work, for tensors it just zeroed);
        the compute stream's next work waits for them."""
        self._mark()
        compute, stream = self._compute(), self._stream
        if after_compute:
            stream.wait_stream(compute)
        read = self._read_until.pop(slot, None)
        if read is not None:
            stream.wait_event(read)
        with torch.cuda.stream(stream):
            yield
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(stream)
        compute.wait_event(done)

    def cleared(self, slot: int) -> None:
        """`slot` was zeroed on the compute stream (its adapter unloaded): a later write waits
        for that as for a read."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._compute())
        self._read_until[slot] = event
