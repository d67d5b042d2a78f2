"""Runs one engine step: SchedulerOutput in, one sampled token per sampled row out.

The runner keeps the running batch's rows between steps (input_batch.py: block tables, each
row's last sampled token on the device) and applies the step's deltas first; the step's flat
batch is then laid out by numpy over the rows (`InputBatch.layout`) and run one of three ways:
a decode graph (decode rows only), a flat step graph (prefill chunks and decode rows in one
replay), or eagerly (`forward` over the whole flat batch, `compute_logits` of the sampled rows
only); sampling follows, and its tokens go back into the rows' last tokens on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedModel

from site_engine.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchReferenceAttention,
)
from site_engine.engine.core.graph_capture import PendingGraph
from site_engine.engine.core.types import (
    ModelRunnerOutput,
    RowJoin,
    ScheduledChunk,
    SchedulerOutput,
)
from site_engine.engine.host_kv import HostKvPool
from site_engine.engine.host_staging import HostStaging
from site_engine.engine.input_batch import InputBatch, StepLayout
from site_engine.engine.kv_cache import PagedKVCache
from site_engine.engine.launched_step import LaunchedStep
from site_engine.engine.logit_processing import GrammarMasks
from site_engine.engine.model_config import eos_token_ids, max_model_len
from site_engine.engine.models import FlatCausalLM, build_flat_model
from site_engine.engine.sampler import Sampler, SampleSpec

if TYPE_CHECKING:
    from site_engine.engine.graphs.decode_graphs import DecodeGraphs
    from site_engine.engine.graphs.flat_step_graphs import FlatStepGraphs
    from site_engine.engine.lora.registry import AdapterRegistry
    from site_engine.engine.lora.slots import LoraSlots, StepDeltas


@dataclass(frozen=True, slots=True)
class StepLogits:
    """A step whose model work is queued and whose sampling is not: the logits of its sampled
    rows, and what sampling them reads. `sample` may wait until the host knows the special
    rows' state (grammars and answer tokens that the previous step's update advances)."""

    logits: torch.Tensor | None  # [N, vocab] float32; None if nothing is sampled
    spec: SampleSpec | None = None
    sample_rows: torch.Tensor | None = None  # [N] the batch row of each, on the device

    @property
    def reads_host_state(self) -> bool:
        """Whether sampling reads state that the previous step's update changes."""
        special = self.spec.special if self.spec is not None else ()
        return any(c.guide is not None or c.sampling.penalized for _, c in special)

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads rows' answer tokens (penalties): the whole previous update."""
        special = self.spec.special if self.spec is not None else ()
        return any(c.sampling.penalized for _, c in special)


@dataclass(frozen=True, slots=True)
class StepTensors:
    """Device tensors of one step's eager forward pass, built from its layout."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    lora: StepDeltas | None = None  # the rows' LoRA deltas; None: no row uses an adapter


def _check_placement(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a model that is not where the cache will be: converting would copy the weights."""
    param = next(model.parameters())
    same_device = param.device.type == device.type and (
        device.index is None or param.device.index == device.index
    )
    if not same_device or param.dtype != dtype:
        raise ValueError(
            f"model is on {param.device} as {param.dtype} but the runner was asked for {device} "
            f"as {dtype}; load it with dtype= and move it before building the runner"
        )


def _check_lora_support(flat_model: FlatCausalLM) -> None:
    """LoRA rows run in the Llama-family models: the eager one on CPU (one-hot GEMMs over all
    slots), the fused one on CUDA (segmented Triton kernels, inside the graphs too)."""
    if not hasattr(flat_model, "lora"):
        raise ValueError(f"{type(flat_model).__name__} does not apply LoRA adapters")


def _default_attention(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    if device.type == "cuda":
        # Imported only here: Triton exists only where CUDA does.
        from site_engine.engine.cuda.attention import CudaPagedAttention
        from site_engine.engine.cuda.cudnn_prefill import CudnnLongPrefill

        # cuDNN's attention takes half precision only; a float32 model keeps its long-chunk
        # steps in the captured graphs.
        half = dtype in (torch.bfloat16, torch.float16)
        return CudaPagedAttention(CudnnLongPrefill.create() if half else None)
    return TorchReferenceAttention()


@dataclass(frozen=True, slots=True)
class _GraphSettings:
    """What the CUDA graph sets are made with (again after a resize of the cache)."""

    max_batch: int
    max_tokens: int
    only_largest: bool
    lora: LoraSlots | None
    logits_out: torch.Tensor
    lazy: bool


class ModelRunner:
    """Owns the paged KV cache and runs the loaded model over flat batches."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        attention: AttentionBackend | None = None,
        sampler: Sampler | None = None,
        cuda_graph_max_batch: int = 0,
        cuda_graph_max_tokens: int = 0,
        only_largest_graphs: bool = False,
        host_kv_slots: int = 0,
        adapters: AdapterRegistry | None = None,
        lazy_graphs: bool = False,
        max_rows: int = 0,
        graph_capture: bool = True,
    ) -> None:
        """cuda_graph_max_batch > 0 (CUDA only) captures decode steps of up to that many
        sequences in CUDA graphs; with cuda_graph_max_tokens >= 2 too, steps with prefill chunks
        of up to that many tokens (and that many sequences) are captured as well, as one flat
        batch. Larger steps run eagerly. only_largest_graphs: one graph of each kind, the
        largest (the memory trial's runner: every step runs, padded, through those two).
        host_kv_slots > 0 adds the prefix cache's host tier (site_engine/engine/host_kv.py),
        whose copies each step's SchedulerOutput lists. `adapters`: the LoRA adapters whose
        deltas rows of a step may add (site_engine/engine/lora/). `lazy_graphs`: capture no graph
        here; `pending_graphs` lists them for the engine to capture between steps, and a step
        whose graph is not captured yet runs eagerly (site_engine/engine/core/graph_capture.py).
        `max_rows`: rows of the running batch (the scheduler's max_num_seqs; default: the
        graphs' batch, at least 64). `graph_capture` False builds the graph runners on any
        device without capturing them: their staging and static-buffer forward run eagerly
        (tests of the graph paths on the CPU, under Triton's interpreter)."""
        _check_placement(model, device, dtype)
        model.train(False)  # dropout must be off; serving never trains
        self.model = model
        self.device = device
        self.block_size = block_size
        self._max_model_len = max_model_len(model.config)
        self.attention: AttentionBackend = attention or _default_attention(device, dtype)
        self.flat_model: FlatCausalLM = build_flat_model(model, self.attention)
        self.adapters = adapters
        if adapters is not None:
            _check_lora_support(self.flat_model)
        use_graphs = (device.type == "cuda" or not graph_capture) and cuda_graph_max_batch > 0
        self._graph_capture = graph_capture
        lora_slots = adapters.slots if adapters is not None and use_graphs else None
        if lora_slots is not None:
            lora_slots.allocate_all()  # the graphs capture the tensors they read
        self._num_blocks = num_blocks
        self.kv_cache = PagedKVCache(
            self.flat_model.spec,
            # Graph padding rows write into one extra block that no sequence is ever given.
            num_blocks=num_blocks + int(use_graphs),
            block_size=block_size,
            dtype=dtype,
            device=device,
        )
        self.host_kv = HostKvPool(self.kv_cache, host_kv_slots) if host_kv_slots else None
        self.sampler = sampler or Sampler()
        rows = max_rows or max(cuda_graph_max_batch, 64)
        self.batch = InputBatch(rows, self.max_blocks_per_seq, block_size, device)
        self._staging = HostStaging(device)
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: FlatStepGraphs | None = None
        self._graph_settings: _GraphSettings | None = None
        if use_graphs:
            # One float32 logits buffer every graph writes into (graphs/decode_graphs.py: why).
            logits_out = torch.empty(
                (cuda_graph_max_batch, self.flat_model.vocab_size),
                dtype=torch.float32,
                device=device,
            )
            self._graph_settings = _GraphSettings(
                cuda_graph_max_batch, cuda_graph_max_tokens, only_largest_graphs, lora_slots,
                logits_out, lazy_graphs,
            )  # fmt: skip
            self._make_graphs(self._graph_settings)

    def _make_graphs(self, settings: _GraphSettings) -> None:
        """The graph sets over the cache as it is now (its scratch block the top one),
        captured unless lazy."""
        from site_engine.engine.graphs.decode_graphs import DecodeGraphs
        from site_engine.engine.graphs.flat_step_graphs import FlatStepGraphs

        shared: dict[str, Any] = {
            "max_blocks_per_seq": self.max_blocks_per_seq,
            "scratch_block": self._num_blocks,
            "logits_out": settings.logits_out,
            "only_largest": settings.only_largest,
            "lora": settings.lora,
        }
        model = (self.flat_model, self.attention, self.kv_cache)
        capture = self._graph_capture
        self.graphs = DecodeGraphs(*model, max_batch=settings.max_batch, capture=capture, **shared)
        if not settings.lazy:
            self.graphs.capture()
        if settings.max_tokens >= 2:
            self.step_graphs = FlatStepGraphs(
                *model, max_tokens=settings.max_tokens, max_seqs=settings.max_batch,
                capture=capture, **shared,
            )  # fmt: skip
            if not settings.lazy:
                self.step_graphs.capture()

    def resize_kv(self, num_blocks: int) -> None:
        """The KV cache shrinks or grows to `num_blocks` (blocks for sequences: the scheduler's
        count), the blocks below both sizes kept (kv_cache.PagedKVCache.resize); blocks above
        `num_blocks` must be free. The step in flight, if any, is finished on the device first
        (no queued kernel or host-tier copy may read a dropped layer). The CUDA graphs hold the
        old layers' addresses: dropped and made again, over the new cache, captured here
        (eager graphs) or listed by `pending_graphs` again (lazy graphs: the engine re-queues
        them; steps run eagerly meanwhile). On failure the cache keeps its old size."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.host_kv is not None:
            self.host_kv.synchronize()
        for graphs in (self.graphs, self.step_graphs):
            if graphs is not None:
                graphs.close()
        self.graphs = self.step_graphs = None
        settings = self._graph_settings
        try:
            # Graph padding rows write into one extra block, the top one.
            self.kv_cache.resize(num_blocks + int(settings is not None))
            self._num_blocks = num_blocks
        finally:
            if settings is not None:
                self._make_graphs(settings)

    def pending_graphs(self) -> list[PendingGraph]:
        """The graphs not captured yet, one capture callable each (lazy graphs; none on CPU):
        the decode graphs first (most steps of a new site's first requests), then the flat
        step graphs. Each must be called with no step of this runner queued on the device."""
        pending: list[PendingGraph] = []
        for graphs in (self.graphs, self.step_graphs):
            if graphs is not None and not graphs.num_graphs:
                pending += graphs.pending()
        return pending

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured (decode and flat step graphs together)."""
        return sum(g.num_graphs for g in (self.graphs, self.step_graphs) if g is not None)

    def close(self) -> None:
        """Frees the graphs and the KV cache now; the runner cannot run steps afterwards."""
        for graphs in (self.graphs, self.step_graphs):
            if graphs is not None:
                graphs.close()
        self.graphs = self.step_graphs = None
        self.kv_cache.release()
        self.sampler.close()
        self.attention.close()

    @property
    def num_blocks(self) -> int:
        """Blocks the scheduler may hand out (the cache may hold one more, for graph padding)."""
        return self._num_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return eos_token_ids(self.model)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self._max_model_len // self.block_size)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.launch(output).result()

    def launch(self, output: SchedulerOutput) -> LaunchedStep:
        """Queue one step's device work and return without waiting for it."""
        return self.sample(self.launch_logits(output))

    def execute_chunks(
        self, chunks: Sequence[ScheduledChunk], finished: frozenset[str] = frozenset()
    ) -> ModelRunnerOutput:
        """Run a step of hand-made chunks (tests, benches, the memory trial): chunk i in row i,
        its table as given; a one-token chunk past position 0 that samples is a decode row whose
        token is the one given. The rows' state before it is gone. The sampled tokens come back
        by request id too (ModelRunnerOutput.sampled_token_ids)."""
        output, decodes = step_of_chunks(chunks, finished)
        if decodes:
            rows, tokens = zip(*decodes, strict=True)
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            values = torch.tensor(tokens, dtype=torch.long, device=self.device)
            self.batch.last_token.index_copy_(0, index, values)
        result = self.execute(output)
        assert result.tokens is not None
        by_id = dict(zip(output.sample_request_ids(), result.tokens.tolist(), strict=True))
        return ModelRunnerOutput(by_id, result.logprobs, result.tokens)

    def layout_chunks(self, chunks: Sequence[ScheduledChunk]) -> StepLayout:
        """The flat batch of hand-made chunks (as `execute_chunks` lays them out), their rows
        taken: for `forward` alone (tests)."""
        output, decodes = step_of_chunks(chunks)
        if decodes:
            raise ValueError("layout_chunks takes prefill chunks only")
        self.batch.apply(output)
        self._validate(output)
        names = self.batch.adapters_of(output)
        slots = self.adapters.assign_names(names) if self.adapters is not None and names else None
        return self.batch.layout(output, slots)

    def prepare_masks(self, step: StepLogits, background: bool = False) -> GrammarMasks | None:
        """The grammar masks of the step's constrained rows, for `sample`
        (Sampler.prepare_masks)."""
        if step.spec is None:
            return None
        return self.sampler.prepare_masks(step.spec, self.vocab_size, self.device, background)

    def sample(self, step: StepLogits, masks: GrammarMasks | None = None) -> LaunchedStep:
        """Queue the sampling of a step whose logits are queued; the sampled tokens become their
        rows' last tokens (the next step's decode inputs) on the device."""
        if step.logits is None or step.spec is None or step.sample_rows is None:
            return LaunchedStep.nothing_sampled()
        with torch.inference_mode():
            sampled = self.sampler.sample_step(step.logits, step.spec, masks)
            self.batch.feed(step.sample_rows, sampled.ids)
            return LaunchedStep.start(step.spec.special, sampled)

    def launch_logits(self, output: SchedulerOutput) -> StepLogits:
        """`launch` up to the logits: the model's work is queued, sampling is left to `sample`."""
        self.sampler.forget(output.finished_request_ids)
        if output.kv_copies:
            if self.host_kv is None:
                raise ValueError("the step lists host KV copies but the runner has no host tier")
            self.host_kv.run(
                output.kv_copies,
                output.kv_copies_before_step,
                output.step_id,
                output.kv_copies_wait_for_step,
            )
        elif self.host_kv is not None and output.kv_copies_wait_for_step:
            # This step overwrites a block a previous step's copy to the host may still be
            # reading, or reads blocks a previous step's copies back from it wrote.
            self.host_kv.run((), 0, output.step_id, output.kv_copies_wait_for_step)
        self.batch.apply(output)
        if output.adapter_slots is not None and self.adapters is not None:
            # Unified slots: the scheduler's placement first (an empty step may carry one).
            self.adapters.place(output.adapter_slots)
        if output.is_empty:
            return StepLogits(None)
        adapter_slot: dict[str, int] | None = None
        if self.adapters is not None:
            # Every adapter of the step into a slot first, all parts of the step at once.
            names = self.batch.adapters_of(output)
            if names:
                adapter_slot = self.adapters.assign_names(names)
        self._validate(output)
        layout = self.batch.layout(output, adapter_slot)
        self._validate_slots(layout)
        with torch.inference_mode():
            logits = self._run(layout)
            if logits is None or not layout.num_sampled:
                return StepLogits(None)
            rows = self._staging.values("sample rows", layout.sample_rows, torch.long)
        spec = SampleSpec(layout.temperature, layout.top_p, layout.generated, layout.special)
        return StepLogits(logits, spec, rows)

    def _run(self, layout: StepLayout) -> torch.Tensor | None:
        """The logits of the step's sampled entries, by a flat step graph, a decode graph (its
        prefill chunks, if any, eagerly beside it) or eagerly."""
        count, chunks = layout.num_decodes, layout.chunks
        long_chunks = self.attention.needs_eager(layout.long_chunks()) if chunks else False
        step_graphs = self.step_graphs
        if (
            chunks
            and not long_chunks
            and step_graphs is not None
            and step_graphs.fits(layout)
            and step_graphs.ready(layout)
        ):
            return step_graphs.run(layout, self.batch)
        graphs = self.graphs
        if count and not long_chunks and graphs is not None and graphs.ready(count):
            # A long chunk for the attention's eager path: the decode rows join its forward
            # rather than reading every weight again in a decode graph.
            logits = graphs.run(layout, self.batch)
            if not chunks:
                return logits
            rest = self._eager(_without_decodes(layout))
            return logits if rest is None else torch.cat([logits, rest])
        return self._eager(layout)

    def _eager(self, layout: StepLayout) -> torch.Tensor | None:
        """The step's forward pass launched op by op, and the sampled entries' logits."""
        hidden = self.forward(layout)
        if not layout.num_sampled:
            return None
        index = self._staging.values("sample index", layout.sample_index, torch.long)
        return self.flat_model.compute_logits(hidden.index_select(0, index))

    def step_tensors(self, layout: StepLayout) -> StepTensors:
        """A layout's device tensors for an eager forward pass."""
        staging, count = self._staging, layout.num_decodes
        input_ids = staging.values("input ids", layout.token_ids, torch.long)
        rows = staging.values("rows", layout.rows, torch.long)
        if count:
            input_ids[:count] = self.batch.last_token.index_select(0, rows[:count])
        tables = self.batch.tables_dev[:, : layout.widest]
        query_start = layout.query_start
        context_lens = layout.context_lens
        metadata = AttentionMetadata(
            slot_mapping=staging.values("slots", layout.slots, torch.long),
            query_start_loc=staging.values("query start", query_start, torch.int32),
            context_lens=staging.values("context lens", context_lens, torch.int32),
            block_tables=tables.index_select(0, rows),
            max_query_len=int((query_start[1:] - query_start[:-1]).max()),
            max_context_len=layout.max_context,
            query_start_loc_host=tuple(query_start.tolist()),
            context_lens_host=tuple(context_lens.tolist()),
        )
        positions = staging.values("positions", layout.positions, torch.long)
        lora = None
        if self.adapters is not None and layout.lora_slots is not None:
            token_slots = staging.values("lora slots", layout.lora_slots, torch.long)
            lora = self.adapters.slots.step(token_slots)
        return StepTensors(input_ids, positions, metadata, lora)

    def forward(self, layout: StepLayout) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token of the step; fills the KV cache."""
        return self.forward_tensors(self.step_tensors(layout))

    def forward_tensors(self, inputs: StepTensors) -> torch.Tensor:
        """`forward` of a step's device tensors (step_tensors)."""
        self.attention.prepare(inputs.metadata)
        args = (inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        if inputs.lora is None:
            return self.flat_model.forward(*args)
        self.flat_model.lora = inputs.lora  # type: ignore[attr-defined]
        try:
            return self.flat_model.forward(*args)
        finally:
            self.flat_model.lora = None  # type: ignore[attr-defined]

    def _validate(self, output: SchedulerOutput) -> None:
        """Cheap checks, over the whole step at once, that turn scheduler bugs into errors
        instead of a corrupted cache."""
        rows = np.concatenate(
            [output.decode_rows, np.array([c.row for c in output.prefill_chunks], dtype=np.int64)]
        )
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.batch.max_rows):
            raise ValueError(f"a row of the step is outside the batch's {self.batch.max_rows}")
        if rows.size > 1 and int(np.bincount(rows).max()) > 1:
            names = [c.request_id for c in output.prefill_chunks] + [
                s.request_id for s in output.decode_seqs
            ]
            raise ValueError(f"a request scheduled twice in one step: {sorted(names)}")
        for chunk in output.prefill_chunks:
            end = chunk.start_position + chunk.num_tokens
            if chunk.num_tokens < 1 or chunk.start_position < 0:
                raise ValueError(f"request {chunk.request_id!r}: empty chunk or negative start")
            self._check_covered(chunk.request_id, end, len(chunk.block_table))
        if output.num_decodes:
            positions = output.decode_positions
            bad = (positions >= self.max_model_len) | (
                output.decode_tables * self.block_size <= positions
            )
            for i in np.flatnonzero(bad).tolist():
                request_id = output.decode_seqs[i].request_id
                self._check_covered(request_id, int(positions[i]) + 1, int(output.decode_tables[i]))

    def _check_covered(self, request_id: str, end: int, blocks: int) -> None:
        if end > self.max_model_len:
            raise ValueError(
                f"request {request_id!r} reaches position {end - 1}, beyond the "
                f"model's max length {self.max_model_len}"
            )
        if blocks * self.block_size < end:
            raise ValueError(
                f"request {request_id!r}: {blocks} blocks of {self.block_size} cannot hold "
                f"{end} positions"
            )

    def _validate_slots(self, layout: StepLayout) -> None:
        slots = layout.slots
        if slots.size and (
            int(slots.min()) < 0 or int(slots.max()) >= self.num_blocks * self.block_size
        ):
            raise ValueError("a step's token has a block id out of range")


def _without_decodes(layout: StepLayout) -> StepLayout:
    """The prefill chunks of a layout alone (its decode rows ran in a decode graph)."""
    count = layout.num_decodes
    tokens = layout.query_start[count]
    special = tuple((i - count, chunk) for i, chunk in layout.special if i >= count)
    lora = layout.lora_slots
    return replace(
        layout,
        num_decodes=0,
        rows=layout.rows[count:],
        token_ids=layout.token_ids[tokens:],
        positions=layout.positions[tokens:],
        slots=layout.slots[tokens:],
        query_start=layout.query_start[count:] - tokens,
        context_lens=layout.context_lens[count:],
        sample_index=layout.sample_index[count:] - tokens,
        sample_rows=layout.sample_rows[count:],
        generated=layout.generated[count:],
        temperature=layout.temperature[count:],
        top_p=layout.top_p[count:],
        lora_slots=None if lora is None else lora[tokens:],
        max_context=int(layout.context_lens[count:].max()),
        special=special,
    )


def step_of_chunks(
    chunks: Sequence[ScheduledChunk], finished: frozenset[str] = frozenset()
) -> tuple[SchedulerOutput, list[tuple[int, int]]]:
    """A SchedulerOutput running hand-made `chunks` (chunk i in row i, its table given whole),
    and the (row, token) of its decode rows: one-token chunks past position 0 that sample,
    whose token the caller puts into the rows' last tokens first."""
    joined: list[RowJoin] = []
    table_rows: list[int] = []
    table_cols: list[int] = []
    table_blocks: list[int] = []
    prefill: list[ScheduledChunk] = []
    decodes: list[tuple[int, int]] = []
    positions: list[int] = []
    generated: list[int] = []
    held: list[int] = []
    for row, chunk in enumerate(chunks):
        joined.append(
            RowJoin(
                row,
                chunk.request_id,
                chunk.sampling,
                chunk.adapter,
                chunk.guide,
                chunk.history,
                chunk.prompt_token_ids,
            )
        )
        table_rows += [row] * len(chunk.block_table)
        table_cols += range(len(chunk.block_table))
        table_blocks += chunk.block_table
        if chunk.num_tokens == 1 and chunk.sample and chunk.start_position > 0:
            decodes.append((row, chunk.token_ids[0]))
            positions.append(chunk.start_position)
            generated.append(chunk.num_generated)
            held.append(len(chunk.block_table))
        else:
            prefill.append(replace(chunk, row=row))
    rows = np.array([row for row, _ in decodes], dtype=np.int64)
    output = SchedulerOutput(
        prefill_chunks=tuple(prefill),
        prefill_serials=tuple(range(len(prefill))),
        decode_rows=rows,
        decode_positions=np.array(positions, dtype=np.int64),
        decode_generated=np.array(generated, dtype=np.int64),
        decode_serials=rows.copy(),
        decode_pending=np.zeros(len(decodes), dtype=np.bool_),
        decode_tables=np.array(held, dtype=np.int64),
        decode_seqs=[_ChunkSeq(chunks[row]) for row, _ in decodes],  # type: ignore[misc]
        joined=tuple(joined),
        table_delta=(
            np.array(table_rows, dtype=np.int64),
            np.array(table_cols, dtype=np.int64),
            np.array(table_blocks, dtype=np.int64),
        ),
        finished_request_ids=finished,
    )
    return output, decodes


class _ChunkSeq:
    """What a hand-made decode row's SchedulerOutput needs of a sequence: its request id."""

    __slots__ = ("request_id",)

    def __init__(self, chunk: ScheduledChunk) -> None:
        self.request_id = chunk.request_id
