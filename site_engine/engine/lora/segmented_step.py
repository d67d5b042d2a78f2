"""A step's LoRA deltas through the segmented Triton kernels (CUDA).

The kernels are cuda/lora_segmented.py: a shrink and an expand launch per stack, 16-row tiles
at decode (64 past 512 tokens), a grid sized for the worst case. On an H200 they took 1.88 ms
(8 adapters) and 3.48 ms (64) of a 256-row decode step of the 8B shape, 1.204x and 1.375x the
base's step (bench/results/engine_lora/lora_profile_h200_segmented.md).

The one kernel path: the paths that measured no better on the GPU were deleted, not kept
selectable (issue 77). Issue 69's one-launch kernels were slower on every figure (git show
8494ebf:site_engine/engine/cuda/lora_kernels.py); issue 77's split-K kernels tied these (git
tag study/lora-splitk; bench/results/engine_lora/kernel_notes_77.md, Result).

The kernels live in cuda/, below lora/: they take plain tensors and a launcher object
(`StackLauncher`), never the slots; this module reads the slots and calls them. The kernel
module is imported only on CUDA (triton is not a CPU dependency).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from site_engine.engine.lora.slots import LoraSlots


class StackLauncher(Protocol):
    """One step's kernel launches (the rows' grouping by slot computed once for the step)."""

    def run(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
        scaling: torch.Tensor, widths: tuple[int, ...],
    ) -> None:  # fmt: skip
        """y[t, cols_j] += (scaling[s] * x[t] @ a[s][:, j*R:(j+1)*R]) @ b[s][:, cols_j] for
        each row t of slot s and each projection j of the stack."""


def launcher(token_slots: torch.Tensor, num_slots: int) -> StackLauncher:
    """The kernels' launcher for a step whose token t uses slot token_slots[t]."""
    from site_engine.engine.cuda.lora_segmented import SegmentedLauncher

    return SegmentedLauncher(token_slots, num_slots)


class SegmentedLoraStep:
    """A step's LoRA deltas through the kernels' launcher: lora/slots.py's SegmentedTorchStep
    on CUDA, over the same slot tensors."""

    def __init__(self, slots: LoraSlots, launches: StackLauncher) -> None:
        self._slots = slots
        self._launches = launches

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's delta of `proj` in `layer` (y may be a column slice of a fused
        projection's output)."""
        tensors = self._slots.stacked(proj)
        if tensors is None:
            return  # no adapter in a slot targets this projection
        a, b = tensors
        stack, rank = self._slots.stacks[proj], self._slots.max_rank
        column = stack.projections.index(proj) * rank
        first, end = stack.columns(proj)
        self._launches.run(x, a[layer, :, :, column : column + rank], b[layer, :, :, first:end],
                           y, self._slots.scaling, (end - first,))  # fmt: skip

    def add_stack(
        self, layer: int, projections: tuple[str, ...], x: torch.Tensor, y: torch.Tensor
    ) -> None:
        """y += the deltas of every projection of the stack, its A and B read once."""
        stack = self._slots.stack(projections)
        tensors = self._slots.stacked(projections[0])
        if tensors is None:
            return
        a, b = tensors
        self._launches.run(x, a[layer], b[layer], y, self._slots.scaling, stack.widths)

    def project(
        self, layer: int, proj: str, module: torch.nn.Module, x: torch.Tensor
    ) -> torch.Tensor:
        """module(x) (the base GEMM, once for all rows) plus each row's delta."""
        y: torch.Tensor = module(x)
        self.add(layer, proj, x, y)
        return y
