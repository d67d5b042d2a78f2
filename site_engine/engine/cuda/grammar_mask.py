"""Grammar masks applied to a step's logits in one kernel.

Applying packed masks with torch ops took ~0.44 ms of host time a step at 256 rows (128
constrained) on the H100 machine: seven launches (unpack by shifts, compare, gather the rows,
fill, scatter them back), each a few tens of microseconds of Python and dispatch while small
decode steps are bound by the host (bench/results/gpu_sessions/gpu_runs_2026-11-25.md). This kernel
reads each constrained row's packed words and writes -inf into that row of the logits where a
token's bit is 0: one launch, no intermediate tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # tokens per program: 64 words of one row


@triton.jit
def _mask_kernel(
    logits_ptr,
    logits_stride,
    words_ptr,
    words_stride,
    rows_ptr,
    vocab,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    row = tl.load(rows_ptr + g).to(tl.int64)
    word = tl.load(words_ptr + g * words_stride + tokens // 32, mask=inside, other=-1)
    allowed = (word >> (tokens % 32)) & 1
    tl.store(
        logits_ptr + row * logits_stride + tokens,
        float("-inf"),
        mask=inside & (allowed == 0),
    )


def mask_logits(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """logits: [N, vocab] float32, contiguous rows; words: [G, ceil(vocab / 32)] int32, the
    packed mask of logits row rows[g] (int32 [G]); all on one CUDA device."""
    if words.shape[0] != rows.shape[0]:
        raise ValueError(f"{words.shape[0]} masks for {rows.shape[0]} rows")
    if not rows.shape[0]:
        return
    vocab = logits.shape[1]
    if logits.stride(1) != 1 or words.stride(1) != 1 or words.shape[1] * 32 < vocab:
        raise ValueError("mask_logits needs contiguous rows and a word for every 32 tokens")
    grid = (rows.shape[0], triton.cdiv(vocab, _BLOCK))
    _mask_kernel[grid](logits, logits.stride(0), words, words.stride(0), rows, vocab, BLOCK=_BLOCK)
