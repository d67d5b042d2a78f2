"""The model runner's half of the running batch (issue 66): what it keeps of every row between
steps, and one step's flat batch laid out on the host from the scheduler's deltas.

The scheduler tells a step as what changed (core/types.py SchedulerOutput): rows that joined
(their sampling, adapter, grammar), blocks appended to rows' tables, prefill chunks, and the decode
rows as arrays. Here each row's block table is kept on the host (numpy) and on the device, and
each row's last sampled token on the device only: after every sampling the step's tokens are
scattered into `last_token`, and a decode row's input token is gathered from it, so a decoding
sequence costs the host nothing but its entries in a few arrays, whether the token it feeds back
is known on the host yet (sync) or not (async scheduling).

`layout` lays out one step's flat batch: decode rows first (one token each), then the prefill
chunks; every array is built by numpy over the rows, with Python only per prefill chunk and per
special row (one whose sampling reads host state or asks for more than a token: logit bias,
penalties, a grammar, logprobs, a seed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from site_engine.engine.core.types import RowJoin, ScheduledChunk, SchedulerOutput

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class StepLayout:
    """One step's flat batch on the host. Entries (sequences) are the decode rows, then the
    prefill chunks; tokens are laid out entry after entry. Sampled entries are the decode rows,
    then the chunks that sample, in that order (the step's sample order)."""

    num_decodes: int
    rows: IntArray  # [S] batch row of each entry
    token_ids: IntArray  # [T] known input tokens (a decode row's: 0, taken on the device)
    positions: IntArray  # [T]
    slots: IntArray  # [T] flat KV cache slot each token's K/V is written to
    query_start: IntArray  # [S + 1]
    context_lens: IntArray  # [S] KV positions each entry reads, this step's included
    sample_index: IntArray  # [N] the flat token each sampled entry's logits come from
    sample_rows: IntArray  # [N] the batch row of each sampled entry
    generated: IntArray  # [N] answer tokens before the one sampled (a seeded row's step)
    temperature: FloatArray  # [N]
    top_p: FloatArray  # [N]
    lora_slots: IntArray | None  # [T] adapter slot of each token (-1: none); None: no adapter
    widest: int  # blocks in the longest table of the step
    max_context: int
    chunks: tuple[ScheduledChunk, ...]  # the prefill chunks
    # Sampled entries that need more than the batch's vectorized sampling, as (sample index,
    # chunk): decode rows among them get a chunk made here (few: special rows only).
    special: tuple[tuple[int, ScheduledChunk], ...]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_entries(self) -> int:
        return int(self.rows.shape[0])

    @property
    def num_sampled(self) -> int:
        return int(self.sample_rows.shape[0])

    @property
    def greedy(self) -> bool:
        """Every sampled entry is greedy and plain: argmax alone samples the step."""
        return not self.special and not bool((self.temperature > 0).any())

    def long_chunks(self) -> list[tuple[int, int]]:
        """(new tokens, context after the step) of each prefill chunk (attention's eager rule)."""
        return [(c.num_tokens, c.start_position + c.num_tokens) for c in self.chunks]


class InputBatch:
    """Every running row's block table (host and device), last sampled token (device),
    sampling values and what it joined with."""

    def __init__(
        self, max_rows: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.max_rows = max_rows
        self.block_size = block_size
        self.device = device
        self.tables = np.zeros((max_rows, max_blocks), dtype=np.int32)
        cuda = device.type == "cuda"
        # On the CPU the device table is the host table itself.
        self.tables_dev = (
            torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=device)
            if cuda
            else torch.from_numpy(self.tables)
        )
        self.last_token = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.temperature = np.ones(max_rows, dtype=np.float32)
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.special = np.zeros(max_rows, dtype=np.bool_)
        self.has_adapter = np.zeros(max_rows, dtype=np.bool_)
        self.joins: list[RowJoin | None] = [None] * max_rows
        self._pin = cuda

    # ---- deltas -----------------------------------------------------------------------------
    def apply(self, output: SchedulerOutput) -> None:
        """The step's joined rows and table growth, on the host and the device."""
        for join in output.joined:
            row = join.row
            if not 0 <= row < self.max_rows:
                raise ValueError(f"row {row} of request {join.request_id!r} is out of range")
            self.joins[row] = join
            sampling = join.sampling
            self.temperature[row] = sampling.temperature
            self.top_p[row] = sampling.top_p
            self.special[row] = not join.plain
            self.has_adapter[row] = bool(join.adapter)
        rows, cols, blocks = output.table_delta
        if not rows.size:
            return
        if int(cols.max()) >= self.tables.shape[1] or int(cols.min()) < 0:
            raise ValueError(f"a table longer than {self.tables.shape[1]} blocks")
        self.tables[rows, cols] = blocks
        if self._pin:
            index = torch.from_numpy(np.stack([rows, cols])).pin_memory()
            values = torch.from_numpy(blocks.astype(np.int32)).pin_memory()
            index = index.to(self.device, non_blocking=True)
            self.tables_dev.index_put_(
                (index[0], index[1]), values.to(self.device, non_blocking=True)
            )

    def feed(self, sample_rows: torch.Tensor, sampled: torch.Tensor) -> None:
        """A step sampled `sampled` for `sample_rows` (device tensors): each row's last token."""
        self.last_token.index_copy_(0, sample_rows, sampled)

    # ---- one step ---------------------------------------------------------------------------
    def layout(
        self, output: SchedulerOutput, adapter_slot: dict[str, int] | None = None
    ) -> StepLayout:
        """The step's flat batch; `adapter_slot`: the slot of each adapter its rows use."""
        size = self.block_size
        decode_rows = output.decode_rows
        count = int(decode_rows.shape[0])
        chunks = output.prefill_chunks
        lens = [chunk.num_tokens for chunk in chunks]
        total = count + sum(lens)
        entries = count + len(chunks)
        rows = np.empty(entries, dtype=np.int64)
        rows[:count] = decode_rows
        positions = np.empty(total, dtype=np.int64)
        positions[:count] = output.decode_positions
        token_ids = np.zeros(total, dtype=np.int64)
        token_rows = np.empty(total, dtype=np.int64)
        token_rows[:count] = decode_rows
        query_start = np.empty(entries + 1, dtype=np.int64)
        query_start[: count + 1] = np.arange(count + 1)
        at = count
        for index, chunk in enumerate(chunks, start=count):
            end = at + chunk.num_tokens
            rows[index] = chunk.row
            positions[at:end] = np.arange(chunk.start_position, chunk.start_position + (end - at))
            token_ids[at:end] = chunk.token_ids
            token_rows[at:end] = chunk.row
            query_start[index + 1] = end
            at = end
        blocks = self.tables[token_rows, positions // size].astype(np.int64)
        slots = blocks * size + positions % size
        context_lens = positions[query_start[1:] - 1] + 1
        sampled_chunks = [i for i, chunk in enumerate(chunks, start=count) if chunk.sample]
        sample_index = np.concatenate(
            [
                np.arange(count, dtype=np.int64),
                query_start[np.array(sampled_chunks, np.int64) + 1] - 1,
            ]
        )
        sample_rows = rows[np.r_[np.arange(count), np.array(sampled_chunks, dtype=np.int64)]]
        generated = np.concatenate(
            [output.decode_generated, [chunks[i - count].num_generated for i in sampled_chunks]]
        ).astype(np.int64)
        widest_decode = int(output.decode_tables.max()) if count else 0
        widest = max([widest_decode, *(len(chunk.block_table) for chunk in chunks)], default=1)
        return StepLayout(
            num_decodes=count,
            rows=rows,
            token_ids=token_ids,
            positions=positions,
            slots=slots,
            query_start=query_start,
            context_lens=context_lens,
            sample_index=sample_index,
            sample_rows=sample_rows,
            generated=generated,
            temperature=self.temperature[sample_rows],
            top_p=self.top_p[sample_rows],
            lora_slots=self._lora_slots(token_rows, adapter_slot),
            widest=max(widest, 1),
            max_context=int(context_lens.max()) if entries else 0,
            chunks=chunks,
            special=self._special(output, sample_rows, generated, sampled_chunks),
        )

    def _lora_slots(
        self, token_rows: IntArray, adapter_slot: dict[str, int] | None
    ) -> IntArray | None:
        if not adapter_slot:
            return None
        slots = np.full(token_rows.shape[0], -1, dtype=np.int64)
        with_adapter = np.flatnonzero(self.has_adapter[token_rows])
        if not with_adapter.size:
            return None
        joins = self.joins
        slots[with_adapter] = [
            adapter_slot[joins[row].adapter] for row in token_rows[with_adapter].tolist()
        ]
        return slots

    def adapters_of(self, output: SchedulerOutput) -> list[str]:
        """The distinct adapters the step's rows use (none: [])."""
        decode = output.decode_rows
        names = {
            join.adapter
            for row in decode[self.has_adapter[decode]].tolist()
            if (join := self.joins[row]) is not None
        }
        names.update(chunk.adapter for chunk in output.prefill_chunks if chunk.adapter)
        return sorted(names)

    def _special(
        self,
        output: SchedulerOutput,
        sample_rows: IntArray,
        generated: IntArray,
        sampled_chunks: Sequence[int],
    ) -> tuple[tuple[int, ScheduledChunk], ...]:
        """The sampled entries whose sampling needs more than the vectorized path."""
        count = output.num_decodes
        special: list[tuple[int, ScheduledChunk]] = []
        for index in np.flatnonzero(self.special[sample_rows[:count]]).tolist():
            join = self.joins[int(sample_rows[index])]
            assert join is not None
            special.append((index, _row_chunk(join, int(generated[index]))))
        chunks = output.prefill_chunks
        for index, at in enumerate(sampled_chunks, start=count):
            chunk = chunks[at - count]
            join = self.joins[chunk.row]
            if join is not None and not join.plain:
                special.append((index, chunk))
        return tuple(special)


def _row_chunk(join: RowJoin, generated: int) -> ScheduledChunk:
    """What the sampler's per-row code reads of a special decode row."""
    penalized = join.sampling.penalized
    return ScheduledChunk(
        request_id=join.request_id,
        token_ids=(),
        start_position=0,
        block_table=(),
        sample=True,
        sampling=join.sampling,
        num_generated=generated,
        guide=join.guide,
        history=join.history if penalized else (),
        prompt_token_ids=join.prompt_token_ids if penalized else (),
        adapter=join.adapter,
        row=join.row,
    )
