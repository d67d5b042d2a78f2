"""Issue 77's "fold the expand into the base GEMM along K" layout, as plain torch functions:
what bench/engine/lora_kfold_gemm.py times and tests/bench/test_lora_kfold_layout.py checks.
Not an engine path (bench/results/engine_lora/kfold_notes_77.md says why it was not built).

For a stack of n projections sharing an input x (lora/slots.py's `Stack`: q/k/v, o, gate/up,
down) with base weight W [out, in], each slot's A [in, n * R] and B [R, out] (the slots' layout),
the stack's weight becomes W_ext = [W | E_0 | ... | E_{S-1}] ([out, in + S * n * R]) and its
input x_ext = [x | S_pad] ([T, in + S * n * R]), so that y = x_ext @ W_ext^T is one GEMM with y
written once:

- E_k [out, n * R] is slot k's B, block-diagonal: projection j's output rows take B's columns
  for j in E_k's columns j*R ... (j+1)*R, every other entry zero. A stack of n projections
  therefore carries n times its B's elements (the zero blocks), and the GEMM multiplies them.
- S_pad holds row t's s = scaling * x[t] @ A[slot_t] (n * R values) in its slot's n * R columns
  and zeros in every other slot's: a row of no adapter has an all-zero S_pad row.
- The zero blocks can be avoided by splitting a stack's GEMM: q | k+v and gate | up as two GEMMs
  each (`split_groups`), the first group's slot columns laid out in reverse on the left of x and
  the second's on its right, x_ext = [S_first reversed | x | S_rest], so that each GEMM reads a
  contiguous window (a view) over x and its own slots' columns, and writes its column range of
  the stack's output (ldc: a view too). What remains block-diagonal is k+v's (2 x R a slot).
- The GEMM may read only a prefix of the slots' columns (a view: W_ext[:, :in + p * n * R] has
  strides (in + S * n * R, 1), which cuBLAS takes as a leading dimension, no copy: torch's
  prepare_matrix_for_cublas, ATen/native/cuda/cuBlasCommonArgs.h), so a step whose rows use
  slots below p pays for p slots, not S.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StackShape:
    """A stack's input features and its projections' output features (side by side)."""

    name: str
    in_features: int
    widths: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.widths)

    @property
    def n(self) -> int:
        return len(self.widths)


def llama_stacks(hidden: int, q: int, kv: int, intermediate: int) -> tuple[StackShape, ...]:
    """The four stacks of a Llama layer, in forward order."""
    return (
        StackShape("qkv", hidden, (q, kv, kv)),
        StackShape("o", q, (hidden,)),
        StackShape("gate_up", hidden, (intermediate, intermediate)),
        StackShape("down", intermediate, (hidden,)),
    )


def ext_columns(stack: StackShape, rank: int, slots: int) -> int:
    """K of the extended GEMM over `slots` slots' columns."""
    return stack.in_features + slots * stack.n * rank


def extend_weight(w: torch.Tensor, stack: StackShape, rank: int, slots: int) -> torch.Tensor:
    """W_ext with W [out, in] in its first columns and every slot's columns zero."""
    out = torch.zeros(
        (stack.out_features, ext_columns(stack, rank, slots)), dtype=w.dtype, device=w.device
    )
    out[:, : stack.in_features].copy_(w)
    return out


def write_slot(w_ext: torch.Tensor, stack: StackShape, rank: int, slot: int,
               b: torch.Tensor | None) -> None:  # fmt: skip
    """Slot `slot`'s B [R', out] (R' <= R: a lower rank's padding stays zero) into its columns
    of W_ext, block-diagonal; None: evicted, the columns zeroed."""
    width = stack.n * rank
    first = stack.in_features + slot * width
    w_ext[:, first : first + width].zero_()
    if b is None:
        return
    row = 0
    for j, out_j in enumerate(stack.widths):
        column = first + j * rank
        w_ext[row : row + out_j, column : column + b.shape[0]].copy_(b[:, row : row + out_j].T)
        row += out_j


def fill_rows(x_ext: torch.Tensor, stack: StackShape, rank: int, shrunk: torch.Tensor,
              token_slots: torch.Tensor) -> None:  # fmt: skip
    """What the shrink would write: row t's s (`shrunk` [T, n * R]) into its slot's columns of
    x_ext, zeros in every other slot's; rows of slot -1 all zero. (The engine's shrink would
    write its own tiles' columns and the zeros once a step: a row's slot is the same in every
    layer.)"""
    extra = x_ext[:, stack.in_features :]
    extra.zero_()
    width = stack.n * rank
    rows = torch.nonzero(token_slots >= 0).squeeze(1)
    if rows.numel() == 0:
        return
    columns = token_slots[rows].unsqueeze(1) * width + torch.arange(width, device=rows.device)
    extra[rows.unsqueeze(1), columns] = shrunk[rows].to(x_ext.dtype)


def split_groups(stack: StackShape, rank: int, used: int) -> list[tuple[int, int, int]]:
    """The split layout's GEMMs: (first output row, end, K) each; the first projection alone,
    the others together (q | k+v, gate | up; o and down are one group)."""
    if stack.n == 1:
        return [(0, stack.out_features, ext_columns(stack, rank, used))]
    first = stack.widths[0]
    return [
        (0, first, stack.in_features + used * rank),
        (first, stack.out_features, stack.in_features + used * (stack.n - 1) * rank),
    ]


def kfold_linear(x_ext: torch.Tensor, w_ext: torch.Tensor, stack: StackShape, rank: int,
                 prefix: int) -> torch.Tensor:  # fmt: skip
    """y = x_ext @ W_ext^T over the base columns and the first `prefix` slots' (views, no copy
    on CUDA)."""
    k = ext_columns(stack, rank, prefix)
    return torch.mm(x_ext[:, :k], w_ext[:, :k].T)


def reference(x: torch.Tensor, w: torch.Tensor, stack: StackShape, shrunk: torch.Tensor,
              b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """x @ W^T plus each row's delta, in float64: projection j's columns get s[:, j*R:(j+1)*R]
    @ B[slot][:, cols_j] (b [slots, R, out]); rows of slot -1 none."""
    rank = b.shape[1]
    y = x.double() @ w.double().T
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).squeeze(1)
        first = 0
        for j, width in enumerate(stack.widths):
            s = shrunk[rows, j * rank : (j + 1) * rank].double()
            y[rows, first : first + width] += s @ b[slot, :, first : first + width].double()
            first += width
    return y
