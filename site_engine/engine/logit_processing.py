"""What happens to a step's logits between the model and the sampler, for the rows that ask for
it: logit_bias, presence/frequency/repetition penalties and grammar masks.

Each is one batched tensor operation over the rows that need it; rows that need none cost
nothing but being skipped. The order is vLLM's and OpenAI's: bias, then penalties, then the
grammar mask last, so that no bias or penalty can bring back a token the grammar forbids.
Masks are applied to the logits a step produced, after the model (and its CUDA graph) ran, so
constrained rows ride in graphed steps like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from site_engine.engine.types import ScheduledChunk

_BITS = 32


def apply_logit_bias(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
    """Adds each row's logit_bias in place (one index_put over every biased entry)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = logits.shape[1]
    for row, chunk in enumerate(chunks):
        for token, bias in chunk.sampling.logit_bias:
            if token < vocab:
                rows.append(row)
                cols.append(token)
                values.append(bias)
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)


def _padded(histories: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(h) for h in histories), default=0) or 1
    table = np.full((len(histories), width), pad, dtype=np.int64)
    for row, history in enumerate(histories):
        table[row, : len(history)] = history
    return torch.from_numpy(table).to(device, non_blocking=True)


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] occurrences of each token id in each row (pad id = vocab is dropped)."""
    counts = torch.zeros(tokens.shape[0], vocab + 1, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
    """OpenAI's presence and frequency penalties (answer tokens) and vLLM's repetition penalty
    (prompt and answer tokens), in place, on the rows that set any."""
    rows = [row for row, chunk in enumerate(chunks) if chunk.sampling.penalized]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    picked = [chunks[row] for row in rows]
    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)
    answers = _counts(_padded([c.history for c in picked], vocab, device), vocab)
    presence = torch.tensor([c.sampling.presence_penalty for c in picked], device=device)
    frequency = torch.tensor([c.sampling.frequency_penalty for c in picked], device=device)
    sub -= frequency.unsqueeze(1) * answers + presence.unsqueeze(1) * (answers > 0)
    repetition = [c.sampling.repetition_penalty for c in picked]
    if any(r != 1.0 for r in repetition):
        prompts = _counts(_padded([c.prompt_token_ids for c in picked], vocab, device), vocab)
        seen = (answers + prompts) > 0
        penalty = torch.tensor(repetition, device=device).unsqueeze(1).expand_as(sub)
        factor = torch.where(sub > 0, 1.0 / penalty, penalty)
        sub = torch.where(seen, sub * factor, sub)
    logits.index_copy_(0, index, sub)


def mask_words(vocab: int) -> int:
    return (vocab + _BITS - 1) // _BITS


def grammar_masks(chunks: Sequence[ScheduledChunk], vocab: int) -> tuple[list[int], np.ndarray]:
    """The rows with a grammar and their masks ([G, words] int32, bit t = token t allowed),
    filled by each row's guide on the host. A guide whose answer is complete allows every
    token: its row's token is never used (the scheduler finished it)."""
    from site_engine.engine.structured_output import fill_masks  # only with constrained rows

    rows = [row for row, chunk in enumerate(chunks) if chunk.guide is not None]
    words = np.empty((len(rows), mask_words(vocab)), dtype=np.int32)
    guides = [chunks[row].guide for row in rows]
    fill_masks([guide for guide in guides if guide is not None], words)
    return rows, words


def apply_grammar_masks(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
    """Sets the logits of every token a row's grammar forbids to -inf, in place."""
    if all(chunk.guide is None for chunk in chunks):
        return
    vocab = logits.shape[1]
    rows, words = grammar_masks(chunks, vocab)
    device = logits.device
    packed = torch.from_numpy(words)
    if device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    shifts = torch.arange(_BITS, device=device, dtype=torch.int32)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, sub)
