"""What happens to a step's logits between the model and the sampler, for the rows that ask for
it: logit_bias, presence/frequency/repetition penalties and grammar masks.

Each is one batched tensor operation over the rows that need it; rows that need none cost
nothing but being skipped. The order is vLLM's and OpenAI's: bias, then penalties, then the
grammar mask last, so that no bias or penalty can bring back a token the grammar forbids.
Masks are applied to the logits a step produced, after the model (and its CUDA graph) ran, so
constrained rows ride in graphed steps like any other.

Every host value reaches the device through the sampler's pinned staging (host_staging.py):
the logits are still being computed when this runs (async scheduling queues the model's work
first), and a plain `torch.tensor(..., device=cuda)` copy would wait for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from site_engine.engine.core.types import ScheduledChunk
from site_engine.engine.host_staging import HostStaging

if TYPE_CHECKING:
    from site_engine.engine.structured_output import MaskFiller

_BITS = 32


# The rows of a step that ask for any of it, as (row of the logits, the row's chunk): a step's
# other rows cost nothing here.
Rows = Sequence[tuple[int, ScheduledChunk]]


def apply_logit_bias(logits: torch.Tensor, rows_in: Rows, staging: HostStaging) -> None:
    """Adds each row's logit_bias in place (one index_put over every biased entry)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = logits.shape[1]
    for row, chunk in rows_in:
        for token, bias in chunk.sampling.logit_bias:
            if token < vocab:
                rows.append(row)
                cols.append(token)
                values.append(bias)
    if not rows:
        return
    index = (staging.values("bias rows", rows, torch.long),
             staging.values("bias tokens", cols, torch.long))  # fmt: skip
    logits.index_put_(index, staging.values("bias", values, logits.dtype), accumulate=True)


def _padded(
    histories: Sequence[Sequence[int]], pad: int, staging: HostStaging, kind: str
) -> torch.Tensor:
    width = max((len(h) for h in histories), default=0) or 1
    table = staging.host_buffer(kind, (len(histories), width), torch.long)
    table.fill(pad)
    for row, history in enumerate(histories):
        table[row, : len(history)] = history
    return staging.to_device(kind, table)


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] occurrences of each token id in each row (pad id = vocab is dropped)."""
    counts = torch.zeros(tokens.shape[0], vocab + 1, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows_in: Rows, staging: HostStaging) -> None:
    """OpenAI's presence and frequency penalties (answer tokens) and vLLM's repetition penalty
    (prompt and answer tokens), in place, on the rows that set any."""
    chosen = [(row, chunk) for row, chunk in rows_in if chunk.sampling.penalized]
    if not chosen:
        return
    vocab = logits.shape[1]
    rows = [row for row, _ in chosen]
    picked = [chunk for _, chunk in chosen]
    index = staging.values("penalized rows", rows, torch.long)
    sub = logits.index_select(0, index)
    answers = _counts(_padded([c.history for c in picked], vocab, staging, "answers"), vocab)
    presence = staging.values("presence", [c.sampling.presence_penalty for c in picked], sub.dtype)
    frequency = staging.values(
        "frequency", [c.sampling.frequency_penalty for c in picked], sub.dtype
    )
    sub -= frequency.unsqueeze(1) * answers + presence.unsqueeze(1) * (answers > 0)
    repetition = [c.sampling.repetition_penalty for c in picked]
    if any(r != 1.0 for r in repetition):
        prompts = _padded([c.prompt_token_ids for c in picked], vocab, staging, "prompts")
        seen = (answers + _counts(prompts, vocab)) > 0
        penalty = staging.values("repetition", repetition, sub.dtype).unsqueeze(1).expand_as(sub)
        factor = torch.where(sub > 0, 1.0 / penalty, penalty)
        sub = torch.where(seen, sub * factor, sub)
    logits.index_copy_(0, index, sub)


def mask_words(vocab: int) -> int:
    return (vocab + _BITS - 1) // _BITS


@dataclass(slots=True)
class GrammarMasks:
    """A step's grammar masks in pinned host memory ([G, vocab / 32] int32, bit t = token t
    allowed; row g for `request_ids[g]`), being filled by `filler` until `ready`."""

    request_ids: tuple[str, ...]
    # G masks of `width` words, then room for the G rows' logits indices: one copy takes both
    # to the device.
    buffer: np.ndarray
    width: int
    filler: MaskFiller | None = None

    @property
    def words(self) -> np.ndarray:
        count = len(self.request_ids)
        return self.buffer[: count * self.width].reshape(count, self.width)

    def ready(self) -> np.ndarray:
        if self.filler is not None:
            self.filler.wait()
            self.filler = None
        return self.words


def prepare_grammar_masks(
    rows_in: Rows,
    vocab: int,
    staging: HostStaging,
    filler: MaskFiller | None = None,
) -> GrammarMasks | None:
    """The masks of the constrained rows among `rows_in`, filled here, or begun on `filler`'s
    thread (the caller goes on with other host work and `apply_grammar_masks` waits for them).

    Each guide writes its mask (a guide whose answer is complete allows every token: its row's
    token is never used) straight into the pinned buffer the masks travel to the device from."""
    from site_engine.engine.structured_output import fill_masks  # only with constrained rows

    guided = [(chunk.request_id, chunk.guide) for _, chunk in rows_in if chunk.guide is not None]
    if not guided:
        return None
    count, width = len(guided), mask_words(vocab)
    buffer = staging.host_buffer("masks", (count * width + count,), torch.int32)
    masks = GrammarMasks(tuple(rid for rid, _ in guided), buffer, width, filler)
    guides = [guide for _, guide in guided]
    if filler is None:
        fill_masks(guides, masks.words)
    else:
        filler.start(guides, masks.words)
    return masks


def apply_grammar_masks(
    logits: torch.Tensor,
    rows_in: Rows,
    staging: HostStaging,
    masks: GrammarMasks | None = None,
) -> None:
    """Sets the logits of every token a row's grammar forbids to -inf, in place, from `masks`
    (prepared for these rows, in any row order) or masks filled now.

    The packed masks travel to the device as they are, a copy 32x smaller than a boolean
    mask, and one kernel unpacks them into the rows they belong to; on the CPU one
    `np.unpackbits` pass unpacks them (bit t of a little-endian word is byte t // 8's bit
    t % 8)."""
    if masks is None:
        masks = prepare_grammar_masks(rows_in, logits.shape[1], staging)
        if masks is None:
            return
    row_of = {chunk.request_id: row for row, chunk in rows_in if chunk.guide is not None}
    if set(row_of) != set(masks.request_ids):
        raise ValueError("the grammar masks were prepared for other rows than these")
    rows = [row_of[rid] for rid in masks.request_ids]
    words = masks.ready()
    vocab, device = logits.shape[1], logits.device
    if device.type == "cuda":
        from site_engine.engine.cuda.grammar_mask import mask_logits

        size = words.size
        masks.buffer[size:] = rows
        packed = staging.to_device("masks", masks.buffer)
        mask_logits(logits, packed[:size].view(words.shape), packed[size:])
        return
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbidden = torch.from_numpy(bits == 0)
    index = torch.tensor(rows, dtype=torch.long)
    sub = logits.index_select(0, index).masked_fill_(forbidden, float("-inf"))
    logits.index_copy_(0, index, sub)
