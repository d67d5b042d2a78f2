"""Steps with prefill chunks replayed from CUDA graphs: the whole flat batch, one graph per
token-count bucket.

Launched eagerly, the forward pass of a prefill or mixed step spends most of its time on the
host (hundreds of kernel launches and compiled-function calls, ~20 ms for a 2,048-token step of a
1B model whose GPU work is ~7 ms). Here every chunk of such a step — prompt chunks (fresh or
continuing cached positions) and decode rows alike — goes into one flat batch padded up to its
bucket's token count, and the bucket's captured forward pass is replayed: embedding, every layer
(attention through the varlen paged kernel over the real sequences only), final norm and the
lm_head of the sampled rows. Decode rows share the prefill tokens' matrix products, so a mixed
step reads the weights once.

The lm_head is a graph of its own, one per count of sampled rows (the decode graphs' sizes): a
bucket's body gathers the hidden states of the rows a step samples into one static buffer, and
the smallest lm_head graph that holds them turns those into logits. Inside the body's graph the
lm_head would have to cover the most rows a bucket can sample, min(tokens, max_num_seqs): at the
GPU default of 1,024 sequences, 1,024 rows of a 128k-vocabulary lm_head (~0.5 TFLOP on a 1B
model, ~1 ms on an H100) for a prefill step that samples one row, or none (a chunk that does
not end its prompt).

Padding, and why it is harmless: padded token rows belong to no sequence (the kernel never
attends from or to them), write their K/V into a scratch block that no sequence owns, and every
other operation is row-wise, so they cannot reach a real row. The per-sequence arrays are padded
with sequences of zero query tokens, which the kernel skips.

Inputs are staged on the host in numpy arrays (pinned when on CUDA) from the step's layout
(input_batch.py) and reach the device in one copy per array; a decode row's input token is its
row's last sampled token and every table is its row's, both gathered on the device from the
running batch's. Two staging sets alternate, as in
graphs.py. Without `capture` (CPU tests) the same static-buffer forward runs eagerly. The logits
go into one static buffer shared with the decode graphs (graphs.py says why). LoRA rows: as in
graphs.py, a static slot-index buffer per token, staged with the other token columns, and a
second body per bucket without the LoRA kernels for steps whose rows have no adapter.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from site_engine.engine.attention import AttentionBackend, AttentionMetadata
from site_engine.engine.core.graph_capture import PendingGraph, lazy_order
from site_engine.engine.graphs.decode_graphs import (
    base_only,
    bucket_sizes,
    capture_buckets,
    capture_one,
    release_graphs,
)
from site_engine.engine.input_batch import InputBatch, StepLayout
from site_engine.engine.kv_cache import PagedKVCache
from site_engine.engine.lora.slots import LoraSlots
from site_engine.engine.models import FlatCausalLM

# Token counts of the captured buckets: fine steps where padding would cost most (a padded
# token costs its share of every matrix product), coarser as the step grows.
_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560,
            3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384)  # fmt: skip
# Host staging columns: per token (known input id, position, slot, the batch row whose last
# token is its input or -1, LoRA slot), per sequence (query start, context length, sampled row,
# batch row: its block table is gathered from the running batch's on the device).
_TOKEN_COLS, _SEQ_COLS = 5, 4


def token_buckets(max_tokens: int, only_largest: bool = False) -> tuple[int, ...]:
    """The step sizes captured; `only_largest`: the largest alone (for a memory trial)."""
    if only_largest:
        return (max_tokens,)
    return (*(b for b in _BUCKETS if b < max_tokens), max_tokens)


@dataclass(slots=True)
class _Bucket:
    graph: torch.cuda.CUDAGraph | None
    output: torch.Tensor | None  # the captured output; None until captured (or eager)


class FlatStepGraphs:
    def __init__(
        self,
        model: FlatCausalLM,
        attention: AttentionBackend,
        kv_cache: PagedKVCache,
        *,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        capture: bool = True,
        logits_out: torch.Tensor | None = None,
        only_largest: bool = False,
        lora: LoraSlots | None = None,
    ) -> None:
        """logits_out: [>= min(max_tokens, max_seqs), vocab] float32 that every bucket writes
        its logits into (allocated here when not given). lora: the adapter slots rows may use
        (run's `lora_slots`)."""
        if max_tokens < 2:
            raise ValueError("flat step graphs need room for at least 2 tokens per step")
        self._model, self._attention, self._kv_cache = model, attention, kv_cache
        self._lora = lora
        self.buckets = token_buckets(max_tokens, only_largest)
        self.max_seqs = max_seqs
        self._capture = capture
        self._block_size = kv_cache.block_size
        self._scratch_block = scratch_block
        self._scratch_slot = scratch_block * self._block_size
        device = kv_cache.device
        self._input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self._slots = torch.full((max_tokens,), self._scratch_slot, dtype=torch.long,
                                 device=device)  # fmt: skip
        self._lora_slots = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self._query_start = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self._context_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self._block_tables = torch.full((max_seqs, max_blocks_per_seq), scratch_block,
                                        dtype=torch.int32, device=device)  # fmt: skip
        self._sample_rows = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self._staged_tokens = torch.zeros((max_tokens, _TOKEN_COLS), dtype=torch.long,
                                          device=device)  # fmt: skip
        self._staged_seqs = torch.zeros((max_seqs + 1, _SEQ_COLS), dtype=torch.long,
                                        device=device)  # fmt: skip
        pin = device.type == "cuda"
        self._host = [
            (
                torch.zeros((max_tokens, _TOKEN_COLS), dtype=torch.long, pin_memory=pin),
                torch.zeros((max_seqs + 1, _SEQ_COLS), dtype=torch.long, pin_memory=pin),
            )
            for _ in range(2)
        ]
        self._turn = 0
        if logits_out is None:
            rows, vocab = min(max_tokens, max_seqs), int(model.vocab_size)
            logits_out = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        self._logits_out = logits_out
        # Sampled rows per lm_head graph; the hidden states of a step's sampled rows, gathered
        # by the body (allocated by the first body, a warm-up, when the hidden width is known).
        self.row_buckets = bucket_sizes(min(max_tokens, max_seqs), only_largest)
        self._sampled_hidden: torch.Tensor | None = None
        self._captured: dict[int, _Bucket] = {}
        self._base_captured: dict[int, _Bucket] = {}  # LoRA engines only (base_only steps)
        self._lm_head: dict[int, _Bucket] = {}
        self._pool: Any = None  # lazy captures' shared memory pool, once the first exists

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def num_graphs(self) -> int:
        return len(self._captured) + len(self._base_captured) + len(self._lm_head)

    def close(self) -> None:
        buckets = (*self._captured.values(), *self._base_captured.values(),
                   *self._lm_head.values())  # fmt: skip
        release_graphs([b.graph for b in buckets if b.graph is not None])
        self._captured.clear()
        self._base_captured.clear()
        self._lm_head.clear()

    def pending(self) -> list[PendingGraph]:
        """What `capture` would capture, one graph per callable (lazy graphs), in `lazy_order`:
        the bodies (a LoRA engine's base-only body of a size after its LoRA one), then the
        lm_heads (until its graph exists, a step's lm_head runs eagerly after the body's replay)."""
        if not self._capture:
            return []
        pending: list[PendingGraph] = []
        for tokens in lazy_order(self.buckets):
            pending.append(PendingGraph(f"step {tokens}", partial(self._capture_body, tokens)))
            if self._lora is not None:
                capture = partial(self._capture_body, tokens, lora=False)
                pending.append(PendingGraph(f"step {tokens} base", capture))
        for rows in lazy_order(self.row_buckets):
            pending.append(PendingGraph(f"lm_head {rows}", partial(self._capture_head, rows)))
        return pending

    def _reset_inputs(self) -> None:
        """The static inputs as at construction: a lazy capture's warm-ups then write K/V into
        the scratch block only, not again into the last step's slots."""
        self._input_ids.zero_()
        self._positions.zero_()
        self._slots.fill_(self._scratch_slot)
        self._lora_slots.fill_(-1)
        self._query_start.zero_()
        self._context_lens.fill_(1)
        self._block_tables.fill_(self._scratch_block)
        self._sample_rows.zero_()

    @torch.inference_mode()
    def _capture_body(self, tokens: int, lora: bool = True) -> None:
        self._reset_inputs()
        graph, hidden = capture_one(tokens, lambda t: self._body(t, lora), self._pool, lazy=True)
        self._pool = graph.pool()
        (self._captured if lora else self._base_captured)[tokens] = _Bucket(graph, hidden)

    @torch.inference_mode()
    def _capture_head(self, rows: int) -> None:
        if self._sampled_hidden is None:  # allocated by a body's first run (its warm-up)
            self._reset_inputs()
            self._body(self.buckets[0])
        graph, logits = capture_one(rows, self._logits, self._pool, lazy=True)
        self._pool = graph.pool()
        self._lm_head[rows] = _Bucket(graph, logits)

    def ready(self, layout: StepLayout) -> bool:
        """Whether the step's body has its graph (lazy graphs: not yet, maybe)."""
        total = layout.num_tokens
        if total > self.max_tokens:
            return False
        if not self._capture:
            return True  # every step runs its bucket's forward eagerly
        return self.buckets[bisect.bisect_left(self.buckets, total)] in self._captured

    def fits(self, layout: StepLayout) -> bool:
        return layout.num_entries <= self.max_seqs and layout.num_tokens <= self.max_tokens

    def _metadata(self, tokens: int) -> AttentionMetadata:
        # The host tuples only give the kernel launcher its grid bounds (tokens, sequences);
        # the real layout is on the device, rewritten before every replay.
        return AttentionMetadata(
            slot_mapping=self._slots[:tokens],
            query_start_loc=self._query_start,
            context_lens=self._context_lens,
            block_tables=self._block_tables,
            max_query_len=tokens,
            max_context_len=self._block_tables.shape[1] * self._block_size,
            query_start_loc_host=(0,) * self.max_seqs + (tokens,),
            context_lens_host=(1,) * self.max_seqs,
            for_graph=True,
        )

    def _body(self, tokens: int, lora: bool = True) -> torch.Tensor:
        """The forward pass of a bucket, up to the sampled rows' hidden states (gathered into
        the static buffer, every row a bucket could sample); `lora`: with the LoRA kernels
        (when the graphs have slots), else the base model alone."""
        metadata = self._metadata(tokens)
        self._attention.prepare(metadata)
        slots = self._lora if lora else None
        if slots is not None:
            # Built inside the capture: the kernels' tiles come from the static buffer.
            self._model.lora = slots.step(self._lora_slots[:tokens])  # type: ignore[attr-defined]
        try:
            hidden = self._model.forward(
                self._input_ids[:tokens], self._positions[:tokens], self._kv_cache, metadata
            )
        finally:
            if slots is not None:
                self._model.lora = None  # type: ignore[attr-defined]
        if self._sampled_hidden is None:
            rows = self.row_buckets[-1]
            self._sampled_hidden = hidden.new_zeros((rows, hidden.shape[1]))
        count = min(tokens, self.max_seqs)
        out = self._sampled_hidden[:count]
        return torch.index_select(hidden, 0, self._sample_rows[:count], out=out)

    def _logits(self, rows: int) -> torch.Tensor:
        """The lm_head of the first `rows` gathered hidden states."""
        assert self._sampled_hidden is not None, "a body runs before any lm_head"
        return self._model.compute_logits(self._sampled_hidden[:rows],
                                          out=self._logits_out[:rows])  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        if not self._capture:
            return
        bodies = capture_buckets(self.buckets, self._body)
        for tokens, (graph, hidden) in bodies.items():
            self._captured[tokens] = _Bucket(graph, hidden)
        # The same memory pool: a step replays its body, then its lm_head, never both at once.
        pool = bodies[self.buckets[-1]][0].pool()
        if self._lora is not None:  # bodies without the LoRA kernels, for base_only steps
            base = capture_buckets(self.buckets, lambda t: self._body(t, False), pool=pool)
            for tokens, (graph, hidden) in base.items():
                self._base_captured[tokens] = _Bucket(graph, hidden)
        for rows, (graph, logits) in capture_buckets(self.row_buckets, self._logits,
                                                     pool=pool).items():  # fmt: skip
            self._lm_head[rows] = _Bucket(graph, logits)

    def _stage(self, layout: StepLayout, tokens: int) -> int:
        """Fills this turn's host arrays from the layout; returns its sampled entries."""
        host_tokens, host_seqs = (t.numpy() for t in self._host[self._turn])
        total, entries = layout.num_tokens, layout.num_entries
        count = layout.num_decodes
        host_tokens[:total, 0] = layout.token_ids
        host_tokens[:total, 1] = layout.positions
        host_tokens[:total, 2] = layout.slots
        # A decode row's input token is its row's last token, on the device.
        host_tokens[:count, 3] = layout.rows[:count]
        host_tokens[count:total, 3] = -1
        host_tokens[:total, 4] = -1 if layout.lora_slots is None else layout.lora_slots
        host_tokens[total:tokens] = (0, 0, self._scratch_slot, -1, -1)
        host_seqs[: entries + 1, 0] = layout.query_start
        host_seqs[entries + 1 :, 0] = total  # padding sequences: zero query tokens
        host_seqs[:entries, 1] = layout.context_lens
        sampled = layout.num_sampled
        host_seqs[:sampled, 2] = layout.sample_index
        host_seqs[sampled:, 2] = 0
        host_seqs[:entries, 3] = layout.rows
        host_seqs[entries:, 3] = 0
        return sampled

    def run(self, layout: StepLayout, batch: InputBatch) -> torch.Tensor:
        """float32 logits [sampled entries, vocab] of one step, in sample order (decode rows,
        then the chunks that sample)."""
        lora_slots = layout.lora_slots
        if lora_slots is not None and self._lora is None:
            raise ValueError("LoRA rows in a step, but the step graphs have no LoRA slots")
        tokens = self.buckets[bisect.bisect_left(self.buckets, layout.num_tokens)]
        self._turn ^= 1
        sampled = self._stage(layout, tokens)
        host_tokens, host_seqs = self._host[self._turn]
        staged = self._staged_tokens[:tokens]
        staged.copy_(host_tokens[:tokens], non_blocking=True)
        self._staged_seqs.copy_(host_seqs, non_blocking=True)
        entries, widest = layout.num_entries, layout.widest
        rows = self._staged_seqs[:entries, 3]
        self._block_tables[:entries, :widest] = batch.tables_dev[:, :widest].index_select(0, rows)
        source = staged[:, 3]
        taken = batch.last_token.index_select(0, source.clamp_min(0))
        self._input_ids[:tokens] = torch.where(source >= 0, taken, staged[:, 0])
        self._positions[:tokens] = staged[:, 1]
        self._slots[:tokens] = staged[:, 2]
        if self._lora is not None:  # a base-only engine's graphs read no slot buffer
            self._lora_slots[:tokens] = staged[:, 4]
        self._query_start.copy_(self._staged_seqs[:, 0])
        self._context_lens.copy_(self._staged_seqs[: self.max_seqs, 1])
        self._sample_rows.copy_(self._staged_seqs[: self.max_seqs, 2])
        base = base_only(lora_slots)
        # Lazy graphs: a size's base-only body may not exist yet where its LoRA one does; the
        # LoRA body computes the same for rows of slot -1.
        bucket = self._base_captured.get(tokens) if base else None
        if bucket is None:
            bucket = self._captured.get(tokens)
        if bucket is None or bucket.graph is None:
            self._body(tokens, lora=not base)  # not captured: the same computation, eagerly
        else:
            bucket.graph.replay()
        if sampled == 0:  # chunks that do not end their prompts: no logits to compute
            return self._logits_out[:0]
        rows_bucket = self.row_buckets[bisect.bisect_left(self.row_buckets, sampled)]
        head = self._lm_head.get(rows_bucket)
        if head is None or head.graph is None:
            return self._logits(sampled)
        head.graph.replay()
        return self._logits_out[:sampled]
