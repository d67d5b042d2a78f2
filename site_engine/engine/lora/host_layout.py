"""An adapter's weights laid out in host memory as its device slot holds them, in a few copies.

Per stack (lora/stacks.py), keyed by its first projection: a [layers, in, P * max_rank], whose
columns j * max_rank ... hold projection j's A.T, and b [layers, max_rank, sum of outs], whose
rows :rank of projection j's output columns hold its B.T; zeros elsewhere (rank padding, layers
and projections the adapter leaves alone). Writing the adapter into a slot is then one copy a
stack tensor (lora/slots.py), where it was two per layer and projection.

Why the file is read in few, large tensor operations: a loader thread re-takes the GIL after
each one, and while the engine's thread runs Python it waits up to the interpreter's switch
interval (5 ms) for it. An 8B rank-16 adapter read tensor by tensor took ~4,000 of them: on
this machine one load took 0.30 s beside an idle thread and 3.2 s beside a thread running
Python 90 % of the time (bench/results/engine_lora/lora_loading_gil.md). Here a load takes
~100 whatever the model's depth: each projection's A (or B) tensors of every layer are, in a
PEFT file, equally spaced in its data section, so one strided view reads them all and one
indexed copy puts each layer in place. A file that is laid out otherwise is read tensor by
tensor, with the same result.

The checks are the adapter's (lora/adapter.py): no NaN or infinite value, and none past the
serving dtype's range once converted. They run over the file's whole data at once; only an
adapter that fails one is read again tensor by tensor, to name the tensor in its error.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from site_engine.engine.lora.adapter_shapes import BaseShapes
from site_engine.engine.lora.stacks import Stack, stacks_of
from site_engine.engine.lora.weights_file import TensorEntry

# (layer, projection) -> {"A": tensor name, "B": tensor name}
Pairs = Mapping[tuple[int, str], Mapping[str, str]]
StackTensors = dict[str, tuple[torch.Tensor, torch.Tensor]]


class LayoutRefused(ValueError):
    """A check failed on the whole data: the caller reads tensor by tensor to say which."""


@dataclass(frozen=True, slots=True)
class HostLayout:
    """Where each projection's A.T and B.T go in a stack's host (and slot) tensors."""

    base: BaseShapes
    max_rank: int

    @property
    def stacks(self) -> dict[str, Stack]:
        return stacks_of(self.base)

    def empty(
        self, projections: set[str], dtype: torch.dtype, pin: bool
    ) -> tuple[StackTensors, dict[str, Stack]]:
        """Zeroed tensors of every stack holding one of `projections`, and each projection's
        stack."""
        stacks = self.stacks
        tensors: StackTensors = {}
        layers, rank = self.base.num_layers, self.max_rank
        for proj in sorted(projections):
            stack = stacks[proj]
            key = stack.projections[0]
            if key in tensors:
                continue
            width = len(stack.projections) * rank
            a = torch.zeros(layers, stack.in_features, width, dtype=dtype, pin_memory=pin)
            b = torch.zeros(layers, rank, stack.out_features, dtype=dtype, pin_memory=pin)
            tensors[key] = (a, b)
        return tensors, stacks

    def views(
        self,
        tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        stacks: Mapping[str, Stack],
        proj: str,
        rank: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """proj's A.T [layers, in, rank] and B.T [layers, rank, out] within the stacks."""
        stack = stacks[proj]
        a, b = tensors[stack.projections[0]]
        column = stack.projections.index(proj) * self.max_rank
        first, end = stack.columns(proj)
        return a[:, :, column : column + rank], b[:, :rank, first:end]


def lay_out_file(
    raw: torch.Tensor,
    entries: Mapping[str, TensorEntry],
    pairs: Pairs,
    layout: HostLayout,
    rank: int,
    dtype: torch.dtype,
    pin: bool,
) -> StackTensors:
    """The adapter whose file's bytes `raw` maps ([size] uint8), laid out; LayoutRefused if
    its data holds a non-finite value or one past `dtype`'s range (or may: a gap between
    tensors is checked too), for the caller to find which tensor."""
    converted = {source: _checked(raw, entries, source, dtype) for source in _dtypes(entries)}
    tensors, stacks = layout.empty({proj for _, proj in pairs}, dtype, pin)
    groups: defaultdict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
    for (layer, proj), names in pairs.items():
        for which in ("A", "B"):
            groups[(proj, which)].append((layer, names[which]))
    for (proj, which), members in groups.items():
        a_t, b_t = layout.views(tensors, stacks, proj, rank)
        target = a_t if which == "A" else b_t
        _copy_group(target, members, entries, converted)
    return tensors


def _dtypes(entries: Mapping[str, TensorEntry]) -> set[torch.dtype]:
    return {entry.dtype for entry in entries.values()}


@dataclass(frozen=True, slots=True)
class _Converted:
    """The data of one source dtype's tensors, from the first one's start, in the serving
    dtype: element i is at byte start + i * itemsize of the file."""

    data: torch.Tensor
    start: int
    itemsize: int

    def element(self, entry: TensorEntry) -> int:
        """The entry's first element, as as_strided counts it (from the storage's start)."""
        return int(self.data.storage_offset()) + (entry.begin - self.start) // self.itemsize


def _checked(
    raw: torch.Tensor, entries: Mapping[str, TensorEntry], source: torch.dtype, dtype: torch.dtype
) -> _Converted:
    mine = [entry for entry in entries.values() if entry.dtype == source]
    itemsize = source.itemsize
    start, end = min(e.begin for e in mine), max(e.end for e in mine)
    if start % itemsize or any(e.begin % itemsize for e in mine):
        raise LayoutRefused("unaligned tensors")  # old writers: read tensor by tensor
    span = raw[start:end].view(source)
    if not bool(torch.isfinite(span).all()):
        raise LayoutRefused("a value is not finite")
    data = span if source == dtype else span.to(dtype)
    if data is not span and not bool(torch.isfinite(data).all()):
        raise LayoutRefused("a value is past the serving dtype's range")
    return _Converted(data, start, itemsize)


def _copy_group(
    target: torch.Tensor,
    members: list[tuple[int, str]],
    entries: Mapping[str, TensorEntry],
    converted: Mapping[torch.dtype, _Converted],
) -> None:
    """target[layer] = each member's tensor, transposed ([layers, x, y] <- [y, x] each)."""
    shape = entries[members[0][1]].shape
    rows, cols = shape
    located = _located(members, entries, converted)
    same_source = len({id(c) for c, _, _ in located}) == 1
    offsets = [c.element(e) for c, e, _ in located]
    strides = {b - a for a, b in itertools.pairwise(offsets)}
    regular = same_source and len(strides) <= 1 and min(strides, default=rows * cols) >= rows * cols
    if regular:
        data = located[0][0].data
        stride = strides.pop() if strides else rows * cols
        view = data.as_strided((len(located), rows, cols), (stride, cols, 1), offsets[0])
        layers = torch.tensor([layer for _, _, layer in located])
        target.index_copy_(0, layers, view.transpose(1, 2))
        return
    for source, entry, layer in located:  # not evenly spaced: one copy a tensor
        view = source.data.as_strided((rows, cols), (cols, 1), source.element(entry))
        target[layer].copy_(view.t())


def _located(
    members: list[tuple[int, str]],
    entries: Mapping[str, TensorEntry],
    converted: Mapping[torch.dtype, _Converted],
) -> list[tuple[_Converted, TensorEntry, int]]:
    """Each member's data, entry and layer, in the file's order."""
    found = [(converted[entries[name].dtype], entries[name], layer) for layer, name in members]
    found.sort(key=lambda item: item[1].begin)
    return found


def lay_out_pairs(
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    layout: HostLayout,
    rank: int,
    dtype: torch.dtype,
    pin: bool = False,
) -> StackTensors:
    """Tensors already in memory, per (layer, projection) A.T [in, rank] and B.T [rank, out],
    laid out (tests, and files read tensor by tensor)."""
    tensors, stacks = layout.empty({proj for _, proj in weights}, dtype, pin)
    for (layer, proj), (a, b) in weights.items():
        a_t, b_t = layout.views(tensors, stacks, proj, rank)
        a_t[layer].copy_(a)
        b_t[layer].copy_(b)
    return tensors
