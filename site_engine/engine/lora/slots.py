"""The adapters a step can use at once (`max_loras` slots), and each row's delta.

Per projection, every slot's weights are stacked in one tensor per layer, zero-padded to the
site's `max_rank` so that adapters of mixed ranks share it:

    a[proj]: [layers, in, slots, max_rank]     b[proj]: [layers, slots, max_rank, out]

A step gives each token a slot index (-1: the base model, no delta). The delta is then two
GEMMs over all slots at once, with the rows of other slots zeroed in between:

    shrunk = (x @ a[l].view(in, slots * r)).view(T, slots, r) * w
    y     += shrunk.view(T, slots * r) @ b[l].view(slots * r, out)

where w[t, s] is slot s's scaling if token t uses slot s, else 0.

`w` is built once per step from the slot index tensor (a one-hot times each slot's scaling), so
no Python runs per row or per slot, shapes do not depend on which rows use which adapter, and the
slot indices stay a tensor input (what a captured CUDA graph needs). The price is `slots` times
the shrink and expand work of one adapter per row, small beside the base GEMM on CPU with a few
slots. On CUDA, `step` gives the segmented Triton kernels' step instead
(site_engine/engine/cuda/lora_kernels.py), which touches each row's own adapter only, over the
same slot tensors. A runner with CUDA graphs allocates every projection's tensors up front
(`allocate_all`): a captured graph reads the tensors it saw at capture, and slots are written in
place.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch
from torch import nn

from site_engine.engine.lora.adapter import BaseShapes, LoraAdapter


class StepDeltas(Protocol):
    """A step's per-row LoRA deltas, as the models apply them (LoraStep here, or the segmented
    kernels' step on CUDA)."""

    def project(self, layer: int, proj: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """module(x) (the base GEMM, once for all rows) plus each row's delta."""
        ...

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's delta of `proj` in `layer`, in place (y may be a column slice)."""
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
    ) -> None:
        self.base = base
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        # Allocated for a projection when the first adapter that targets it takes a slot.
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.scaling = torch.zeros(num_slots, dtype=dtype, device=device)
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first

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
        return {name: self._slot_of[name] for name in wanted}

    def drop(self, name: str) -> None:
        """Forgets `name`'s slot (its adapter is no longer served): the slot is free again."""
        self._slot_of.pop(name, None)

    def _free_slot(self) -> int:
        if len(self._slot_of) < self.num_slots:
            return min(set(range(self.num_slots)) - set(self._slot_of.values()))
        # The oldest entry: assign() moved every adapter the step needs to the end.
        _, slot = self._slot_of.popitem(last=False)
        return slot

    def allocate_all(self) -> None:
        """Every projection's slot tensors now (zero: no delta until an adapter is written)."""
        for proj in self.base.features:
            self._tensors(proj)

    def token_slots(self, names: Iterable[str]) -> list[int]:
        """The slot of each name ("": the base model, -1); every named adapter must hold one."""
        return [self._slot_of[name] if name else -1 for name in names]

    def _tensors(self, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        if proj not in self.a:
            in_f, out_f = self.base.features[proj]
            layers, slots, rank = self.base.num_layers, self.num_slots, self.max_rank
            dtype, device = self.dtype, self.device
            self.a[proj] = torch.zeros(layers, in_f, slots, rank, dtype=dtype, device=device)
            self.b[proj] = torch.zeros(layers, slots, rank, out_f, dtype=dtype, device=device)
        return self.a[proj], self.b[proj]

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """The adapter's weights into `slot`; the rank padding and untargeted modules zero."""
        for proj in self.a:
            self.a[proj][:, :, slot].zero_()
            self.b[proj][:, slot].zero_()
        rank = adapter.rank
        for (layer, proj), (a, b) in adapter.weights.items():
            stacked_a, stacked_b = self._tensors(proj)
            stacked_a[layer, :, slot, :rank].copy_(a, non_blocking=True)
            stacked_b[layer, slot, :rank].copy_(b, non_blocking=True)
        self.scaling[slot] = adapter.scaling
        self._slot_of[adapter.name] = slot

    def step(self, token_slots: torch.Tensor) -> StepDeltas:
        """The deltas of one step whose token t uses slot token_slots[t] ([T] int64, -1: none).
        Only tensor ops on `token_slots`: a graph captured over a static buffer replays it."""
        if self.device.type == "cuda":
            from site_engine.engine.cuda.lora_kernels import SegmentedLoraStep

            return SegmentedLoraStep(self.a, self.b, self.scaling, token_slots)
        return self.one_hot_step(token_slots)

    def one_hot_step(self, token_slots: torch.Tensor) -> LoraStep:
        """The PyTorch path's step on any device (the CPU's; the reference of the kernels')."""
        one_hot = torch.nn.functional.one_hot(token_slots + 1, self.num_slots + 1)[:, 1:]
        weights = (one_hot.to(self.dtype) * self.scaling).unsqueeze(-1)
        return LoraStep(self.a, self.b, weights)


class LoraStep:
    """Applies the step's per-row deltas in the model's projections."""

    def __init__(
        self, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], weights: torch.Tensor
    ) -> None:
        self._a, self._b = a, b
        self._weights = weights  # [T, slots, 1]: each row's scaling in its own slot, else 0

    def project(self, layer: int, proj: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """module(x) (the base GEMM, once for all rows) plus each row's delta."""
        y: torch.Tensor = module(x)
        self.add(layer, proj, x, y)
        return y

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's delta of `proj` in `layer`, in place (y may be a column slice)."""
        a = self._a.get(proj)
        if a is None:
            return  # no adapter in a slot targets this projection
        b = self._b[proj]
        rows = x.shape[0]
        _, in_f, slots, rank = a.shape
        shrunk = (x @ a[layer].view(in_f, slots * rank)).view(rows, slots, rank) * self._weights
        y.addmm_(shrunk.view(rows, slots * rank), b[layer].view(slots * rank, -1))
