"""The adapters a step can use at once (`max_loras` slots), and each row's delta.

Projections that read the same input are stacked (q/k/v, gate/up: `Stack`), so that one shrink
and one expand serve all of them, as Punica's SGMV and vLLM's lora_shrink/lora_expand do for
their "slices". Per stack, every slot's weights are one tensor per layer, each slot's block
contiguous (what the kernels read), ranks zero-padded to the site's `max_rank` (R):

    a[stack]: [layers, slots, in, projections * R]   projection j's A in columns j*R ...
    b[stack]: [layers, slots, R, sum of outs]        projection j's B in its output columns

so a stack's fused output y [T, sum of outs] gets, for token t of slot s,

    y[t, cols_j] += (scaling[s] * x[t] @ a[l, s][:, j*R : (j+1)*R]) @ b[l, s][:, cols_j]

A step gives each token a slot index (-1: the base model, no delta). Each row's delta is computed
from its own slot's weights only (segments of rows by slot, never a mask over all slots): one
tenant's adapter cannot reach another's rows, not even through 0 * NaN, and rows of no adapter
cost nothing. On CUDA `step` gives the segmented Triton kernels' step (lora/segmented_step.py),
whose tiles come from the slot-index tensor on the device (graph-safe); elsewhere
`SegmentedTorchStep` groups the rows on the host (the CPU path: no graphs there). A runner with
CUDA graphs allocates every stack's tensors up front (`allocate_all`): a captured graph reads the
tensors it saw at capture, and slots are written in place (on CUDA with LoraSettings.copy_stream,
on a stream of their own, ordered against the steps by events: lora/slot_copies.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
from torch import nn

from site_engine.engine.lora.adapter import BaseShapes, LoraAdapter
from site_engine.engine.lora.segmented_step import SegmentedLoraStep, launcher
from site_engine.engine.lora.slot_copies import SlotCopies
from site_engine.engine.lora.stacks import Stack, stacks_of


class StepDeltas(Protocol):
    """A step's per-row LoRA deltas, as the models apply them."""

    def project(self, layer: int, proj: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """module(x) (the base GEMM, once for all rows) plus each row's delta."""
        ...

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's delta of `proj` in `layer`, in place (y may be a column slice)."""
        ...

    def add_stack(
        self, layer: int, projections: tuple[str, ...], x: torch.Tensor, y: torch.Tensor
    ) -> None:
        """y += each row's deltas of the stack `projections` (QKV, GATE_UP), whose outputs are
        y's columns side by side, in place."""
        ...


class LoraSlots:
    """`num_slots` adapter slots on the device, reused least recently used first."""

    def __init__(
        self,
        base: BaseShapes,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        copy_stream: bool = False,
    ) -> None:
        self.base = base
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.stacks = stacks_of(base)
        # Allocated for a stack when the first adapter that targets one of its projections
        # takes a slot; keyed by the stack's first projection.
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.scaling = torch.zeros(num_slots, dtype=dtype, device=device)
        self.ranks = [0] * num_slots  # the rank of the adapter in each slot (0: none)
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        # On CUDA, writes go on a stream of their own (lora/slot_copies.py).
        self._copies = SlotCopies(device) if copy_stream and device.type == "cuda" else None
        # Unified slots (core/unified_slots.py): the scheduler chooses each adapter's slot
        # (`place`), and `assign` never evicts one by itself.
        self.placed = False

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def names(self) -> tuple[str, ...]:
        """The adapters in a slot now, least recently used first."""
        return tuple(self._slot_of)

    def assign(self, names: Iterable[str], fetch: Callable[[str], LoraAdapter]) -> dict[str, int]:
        """A slot for each adapter named (they must fit at once); those not in a slot yet take
        a free one, or the least recently used one that none of `names` holds. `fetch` gives an
        adapter's host weights."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} adapters in one step, only {self.num_slots} slots")
        for name in wanted:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
        for name in wanted:
            if name not in self._slot_of:
                self._write(self._free_slot(), fetch(name))
        slots = {name: self._slot_of[name] for name in wanted}
        if self._copies is not None:
            self._copies.assigned(slots.values())
        return slots

    def place(
        self, mapping: Iterable[tuple[str, int]], fetch: Callable[[str], LoraAdapter]
    ) -> None:
        """The slots the scheduler chose (unified slots: every resident adapter's): adapters
        no longer named, or named at another slot, are forgotten (no row reads their slot
        again; a step in flight still may, and the writes are ordered after it), and those
        new in their slot are written into it."""
        self.placed = True
        wanted = dict(mapping)
        for name, slot in list(self._slot_of.items()):
            if wanted.get(name) != slot:
                del self._slot_of[name]
        for name, slot in wanted.items():
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} of adapter {name!r}: only {self.num_slots} slots")
            if name not in self._slot_of:
                self._write(slot, fetch(name))

    def drop(self, name: str) -> None:
        """Forgets `name`'s slot (its adapter is no longer served) and zeroes it: the slot is
        free again and holds nothing of the adapter."""
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._clear(slot)
            if self._copies is not None:
                self._copies.cleared(slot)

    def _free_slot(self) -> int:
        if self.placed:
            raise ValueError("an adapter of the step was not placed by the scheduler")
        if len(self._slot_of) < self.num_slots:
            return min(set(range(self.num_slots)) - set(self._slot_of.values()))
        # The oldest entry: assign() moved every adapter the step needs to the end.
        _, slot = self._slot_of.popitem(last=False)
        return slot

    def allocate_all(self) -> None:
        """Every stack's slot tensors now (zero: no delta until an adapter is written)."""
        for proj in self.stacks:
            self._tensors(proj)

    def token_slots(self, names: Iterable[str]) -> list[int]:
        """The slot of each name ("": the base model, -1); every named adapter must hold one."""
        return [self._slot_of[name] if name else -1 for name in names]

    def stack(self, projections: tuple[str, ...]) -> Stack:
        """The stack of exactly `projections` (a caller's fused GEMM must match the model's)."""
        stack = self.stacks[projections[0]]
        if stack.projections != projections:
            raise ValueError(f"{projections} is not a stack of this model ({stack.projections})")
        return stack

    def stacked(self, proj: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(a, b) of `proj`'s stack (None: no adapter in a slot targets it yet)."""
        key = self.stacks[proj].projections[0]
        return (self.a[key], self.b[key]) if key in self.a else None

    def _tensors(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        stack = self.stacks[proj]
        key = stack.projections[0]
        if key not in self.a:
            layers, slots, rank = self.base.num_layers, self.num_slots, self.max_rank
            width = len(stack.projections) * rank
            dtype, device = self.dtype, self.device
            self.a[key] = torch.zeros(
                layers, slots, stack.in_features, width, dtype=dtype, device=device
            )
            self.b[key] = torch.zeros(
                layers, slots, rank, stack.out_features, dtype=dtype, device=device
            )
        return self.a[key], self.b[key]

    def _clear(self, slot: int) -> None:
        for key in self.a:
            self.a[key][:, slot].zero_()
            self.b[key][:, slot].zero_()
        self.scaling[slot] = 0
        self.ranks[slot] = 0

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """The adapter's weights into `slot`; the rank padding and untargeted modules zero."""
        if adapter.layout.max_rank != self.max_rank:
            raise ValueError(
                f"adapter {adapter.name!r} is laid out at rank {adapter.layout.max_rank}, "
                f"the slots at {self.max_rank}"
            )
        # The stacks' tensors it needs are allocated (zeroed) on the compute stream first.
        missing = {key for key in adapter.stacks if key not in self.a}
        for key in missing:
            self._tensors(key)
        copies = self._copies
        writing: AbstractContextManager[None] = (
            nullcontext() if copies is None else copies.writing(slot, after_compute=bool(missing))
        )
        with writing:
            self._write_in_place(slot, adapter)
        self._slot_of[adapter.name] = slot

    def _write_in_place(self, slot: int, adapter: LoraAdapter) -> None:
        # The host tensors have the slot's layout, padding included: one copy a stack tensor.
        for key, stacked_a in self.a.items():
            stacked_b = self.b[key]
            host = adapter.stacks.get(key)
            if host is None:  # a stack the adapter leaves alone
                stacked_a[:, slot].zero_()
                stacked_b[:, slot].zero_()
                continue
            stacked_a[:, slot].copy_(host[0], non_blocking=True)
            stacked_b[:, slot].copy_(host[1], non_blocking=True)
        self.scaling[slot] = adapter.scaling
        self.ranks[slot] = adapter.rank

    def step(self, token_slots: torch.Tensor) -> StepDeltas:
        """The deltas of one step whose token t uses slot token_slots[t] ([T] int64, -1: none).
        On CUDA only tensor ops on `token_slots`: a graph captured over a static buffer
        replays it."""
        if self.device.type == "cuda":
            launches = launcher(token_slots, self.num_slots)
            return SegmentedLoraStep(self, launches)
        return SegmentedTorchStep(self, token_slots)


class SegmentedTorchStep:
    """The PyTorch path's step (the CPU's; the kernels' reference): the rows of each slot in
    use gathered, their delta computed from that slot's weights at its adapter's own rank, and
    added back into those rows only. The grouping is read on the host once per step."""

    def __init__(self, slots: LoraSlots, token_slots: torch.Tensor) -> None:
        self._slots = slots
        host = token_slots.cpu()
        used = [s for s in torch.unique(host).tolist() if s >= 0]
        self._rows = [(s, torch.nonzero(host == s).squeeze(1).to(token_slots.device)) for s in used]

    def project(self, layer: int, proj: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """module(x) (the base GEMM, once for all rows) plus each row's delta."""
        y: torch.Tensor = module(x)
        self.add(layer, proj, x, y)
        return y

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's delta of `proj` in `layer`, in place (y may be a column slice)."""
        tensors = self._slots.stacked(proj)
        if tensors is None:
            return  # no adapter in a slot targets this projection
        a, b = tensors
        stack = self._slots.stacks[proj]
        column = stack.projections.index(proj) * self._slots.max_rank
        first, end = stack.columns(proj)
        for slot, rows in self._rows:
            rank = self._slots.ranks[slot]
            slot_a = a[layer, slot, :, column : column + rank]
            slot_b = b[layer, slot, :rank, first:end]
            # peft's order: (x @ A.T) @ B.T, then times the scaling.
            delta = (x.index_select(0, rows) @ slot_a) @ slot_b * self._slots.scaling[slot]
            y.index_add_(0, rows, delta)

    def add_stack(
        self, layer: int, projections: tuple[str, ...], x: torch.Tensor, y: torch.Tensor
    ) -> None:
        """y += the deltas of each projection of the stack, into its columns of y."""
        stack = self._slots.stack(projections)
        for proj in projections:
            first, end = stack.columns(proj)
            self.add(layer, proj, x, y[:, first:end])
