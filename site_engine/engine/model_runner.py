"""Runs one engine step: SchedulerOutput in, one sampled token per sampling chunk out.

A step is split into `prepare_inputs` (host-side tensor building), `forward` (the model over the
flat batch), `compute_logits` (only the rows that are sampled) and sampling, so that profiling can
time each piece and GPU work (pinned staging buffers, CUDA graphs, another attention backend) can
replace one of them inside this class without touching the models or the scheduler.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
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
from site_engine.engine.core.types import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from site_engine.engine.host_kv import HostKvPool
from site_engine.engine.kv_cache import PagedKVCache
from site_engine.engine.launched_step import LaunchedStep, no_pending_rows
from site_engine.engine.logit_processing import GrammarMasks
from site_engine.engine.model_config import eos_token_ids, max_model_len
from site_engine.engine.models import FlatCausalLM, build_flat_model
from site_engine.engine.sampler import Sampler

if TYPE_CHECKING:
    from site_engine.engine.cuda.graphs import DecodeGraphs
    from site_engine.engine.cuda.step_graphs import FlatStepGraphs
    from site_engine.engine.lora.registry import AdapterRegistry
    from site_engine.engine.lora.slots import LoraSlots, StepDeltas


@dataclass(frozen=True, slots=True)
class StepLogits:
    """A step whose model work is queued and whose sampling is not: the logits of its sampled
    chunks. `sample` may wait until the host knows what those chunks' sampling reads (grammar
    states and answer tokens that the previous step's update advances)."""

    logits: torch.Tensor | None  # [N, vocab] float32; None if nothing is sampled
    chunks: tuple[ScheduledChunk, ...] = ()

    @property
    def reads_host_state(self) -> bool:
        """Whether sampling reads state that the previous step's update changes."""
        return any(c.guide is not None or c.sampling.penalized for c in self.chunks)

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads rows' answer tokens (penalties): the whole previous update."""
        return any(c.sampling.penalized for c in self.chunks)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Device tensors of one step, built from the scheduled chunks."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [N] int64: flat row of the last token of each sampled chunk
    sample_chunks: tuple[ScheduledChunk, ...]  # the N chunks with sample=True, in batch order
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


def _is_decode(chunk: ScheduledChunk) -> bool:
    """One new token after cached ones, sampled: what the decode graphs run."""
    return chunk.num_tokens == 1 and chunk.sample and chunk.start_position > 0


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
        whose graph is not captured yet runs eagerly (site_engine/engine/core/graph_capture.py)."""
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
        use_graphs = device.type == "cuda" and cuda_graph_max_batch > 0
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
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: FlatStepGraphs | None = None
        self._graph_settings: _GraphSettings | None = None
        if use_graphs:
            # One float32 logits buffer that every graph writes into (cuda/graphs.py says why).
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
        from site_engine.engine.cuda.graphs import DecodeGraphs
        from site_engine.engine.cuda.step_graphs import FlatStepGraphs

        shared: dict[str, Any] = {
            "max_blocks_per_seq": -(-self._max_model_len // self.block_size),
            "scratch_block": self._num_blocks,
            "logits_out": settings.logits_out,
            "only_largest": settings.only_largest,
            "lora": settings.lora,
        }
        model = (self.flat_model, self.attention, self.kv_cache)
        self.graphs = DecodeGraphs(*model, max_batch=settings.max_batch, **shared)
        if not settings.lazy:
            self.graphs.capture()
        if settings.max_tokens >= 2:
            self.step_graphs = FlatStepGraphs(
                *model, max_tokens=settings.max_tokens, max_seqs=settings.max_batch, **shared
            )
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

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.launch(output).result()

    def launch(self, output: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step's device work and return without waiting for it.

        `previous` is the step launched just before, whose sampled tokens this step's pending
        input tokens are (async scheduling); device order makes its results visible here.
        """
        return self.sample(self.launch_logits(output, previous))

    def prepare_masks(self, step: StepLogits, background: bool = False) -> GrammarMasks | None:
        """The grammar masks of the step's constrained rows, for `sample`
        (Sampler.prepare_masks)."""
        return self.sampler.prepare_masks(step.chunks, self.vocab_size, self.device, background)

    def sample(self, step: StepLogits, masks: GrammarMasks | None = None) -> LaunchedStep:
        """Queue the sampling of a step whose logits are queued."""
        if step.logits is None:
            return LaunchedStep.nothing_sampled()
        with torch.inference_mode():
            return LaunchedStep.start(
                step.chunks, self.sampler.sample_step(step.logits, step.chunks, masks)
            )

    def launch_logits(
        self, output: SchedulerOutput, previous: LaunchedStep | None = None
    ) -> StepLogits:
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
        if output.is_empty:
            return StepLogits(None)
        slot_of: dict[str, int] | None = None
        if self.adapters is not None:
            # Every adapter of the step into a slot first, all parts of the step at once.
            slots = self.adapters.assign([chunk.adapter for chunk in output.chunks])
            slot_of = {c.request_id: s for c, s in zip(output.chunks, slots, strict=True)}
        if self._flat_graphed(output.chunks):
            return self._launch_flat(output.chunks, previous, slot_of)
        graphed, eager = self._split(output.chunks)
        logits_parts: list[torch.Tensor] = []
        sampled: list[ScheduledChunk] = []
        with torch.inference_mode():
            if eager:
                inputs = self.prepare_inputs(eager, previous)
                hidden = self.forward(inputs)
                if inputs.sample_chunks:
                    logits_parts.append(self.compute_logits(hidden, inputs))
                    sampled.extend(inputs.sample_chunks)
            if graphed and self.graphs is not None:
                self._validate_decode(graphed)
                rows = previous.pending_rows(graphed) if previous else no_pending_rows(graphed)
                source = previous.sampled if previous is not None else None
                lora_slots = None if slot_of is None else [slot_of[c.request_id] for c in graphed]
                logits_parts.append(self.graphs.run(graphed, rows, source, lora_slots))
                sampled.extend(graphed)
            if not sampled:
                return StepLogits(None)
            logits = logits_parts[0] if len(logits_parts) == 1 else torch.cat(logits_parts)
            return StepLogits(logits, tuple(sampled))

    def _flat_graphed(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """A step with prefill chunks that the flat step graphs can take whole."""
        if self.step_graphs is None or not self.step_graphs.fits(chunks):
            return False
        if not self.step_graphs.ready(chunks):  # lazy graphs: its body is not captured yet
            return False
        if self._attention_needs_eager(chunks):
            return False
        return any(not _is_decode(chunk) for chunk in chunks)

    def _attention_needs_eager(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """A chunk the attention backend runs outside captured graphs (cuDNN's long chunks)."""
        return self.attention.needs_eager(
            [(chunk.num_tokens, chunk.start_position + chunk.num_tokens) for chunk in chunks]
        )

    def _launch_flat(
        self,
        chunks: Sequence[ScheduledChunk],
        previous: LaunchedStep | None,
        slot_of: dict[str, int] | None,
    ) -> StepLogits:
        """The whole step (prefill chunks and decode rows) as one replay of a flat step graph."""
        assert self.step_graphs is not None
        decode = [chunk for chunk in chunks if _is_decode(chunk)]
        self._validate_decode(decode)
        self._validate([chunk for chunk in chunks if not _is_decode(chunk)])
        if len({chunk.request_id for chunk in chunks}) != len(chunks):
            self._validate(chunks)  # names the request scheduled twice
        rows = previous.pending_rows(chunks) if previous else no_pending_rows(chunks)
        source = previous.sampled if previous is not None else None
        sampled = [chunk for chunk in chunks if chunk.sample]
        with torch.inference_mode():
            lora_slots = None if slot_of is None else [slot_of[c.request_id] for c in chunks]
            logits = self.step_graphs.run(chunks, rows, source, lora_slots)
            if not sampled:
                return StepLogits(None)
            return StepLogits(logits, tuple(sampled))

    def _split(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        """(decode chunks for the CUDA graphs, the rest for the eager path)."""
        if self.graphs is None:
            return [], list(chunks)
        graphed: list[ScheduledChunk] = []
        eager: list[ScheduledChunk] = []
        for chunk in chunks:
            (graphed if _is_decode(chunk) else eager).append(chunk)
        if not self.graphs.ready(len(graphed)) or self._attention_needs_eager(eager):
            # A long chunk for the attention's eager path: the decode rows join its forward
            # rather than reading every weight again in a decode graph.
            return [], list(chunks)
        return graphed, eager

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token of the step; fills the KV cache."""
        self.attention.prepare(inputs.metadata)
        if self.adapters is None:
            return self.flat_model.forward(
                inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata
            )
        self.flat_model.lora = inputs.lora  # type: ignore[attr-defined]
        try:
            return self.flat_model.forward(
                inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata
            )
        finally:
            self.flat_model.lora = None  # type: ignore[attr-defined]

    def compute_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """float32 logits [N, vocab] of the sampled rows only (the lm_head is the big matmul)."""
        return self.flat_model.compute_logits(hidden.index_select(0, inputs.sample_indices))

    def prepare_inputs(
        self, chunks: Sequence[ScheduledChunk], previous: LaunchedStep | None = None
    ) -> StepInputs:
        """Flatten the chunks into token, position, slot and block-table tensors; pending input
        tokens are taken from `previous`'s sampled tokens on the device."""
        self._validate(chunks)
        pending = previous.pending_rows(chunks) if previous else no_pending_rows(chunks)
        lens = [chunk.num_tokens for chunk in chunks]
        query_start_loc = list(itertools.accumulate(lens, initial=0))
        context_lens = [chunk.start_position + n for chunk, n in zip(chunks, lens, strict=True)]
        lens_t = torch.tensor(lens)
        # Position of token j of chunk i = start_i + (j - query_start_i), computed for all at once.
        offsets = torch.tensor(
            [c.start_position - q for c, q in zip(chunks, query_start_loc[:-1], strict=True)]
        )
        positions = torch.arange(query_start_loc[-1]) + offsets.repeat_interleave(lens_t)
        max_blocks = max(len(chunk.block_table) for chunk in chunks)
        block_tables = torch.tensor(
            [list(c.block_table) + [0] * (max_blocks - len(c.block_table)) for c in chunks],
            dtype=torch.int32,
        )
        seq_of_token = torch.arange(len(chunks)).repeat_interleave(lens_t)
        block_of_token = block_tables[seq_of_token, positions // self.block_size].long()
        slot_mapping = block_of_token * self.block_size + positions % self.block_size
        sample_rows = [q - 1 for c, q in zip(chunks, query_start_loc[1:], strict=True) if c.sample]
        # numpy reads the ids ~4x faster than torch.tensor(list): at 8k tokens ~0.7 ms less
        # before the step's first kernel can start.
        token_ids = np.fromiter(
            itertools.chain.from_iterable(c.token_ids for c in chunks),
            dtype=np.int64,
            count=query_start_loc[-1],
        )
        metadata = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            query_start_loc=self._to_device(torch.tensor(query_start_loc, dtype=torch.int32)),
            context_lens=self._to_device(torch.tensor(context_lens, dtype=torch.int32)),
            block_tables=self._to_device(block_tables),
            max_query_len=max(lens),
            max_context_len=max(context_lens),
            query_start_loc_host=tuple(query_start_loc),
            context_lens_host=tuple(context_lens),
        )
        input_ids = self._to_device(torch.from_numpy(token_ids))
        if previous is not None and previous.sampled is not None and any(r >= 0 for r in pending):
            # A pending token is its chunk's only token, i.e. the chunk's last flat row.
            flat = [q - 1 for q, r in zip(query_start_loc[1:], pending, strict=True) if r >= 0]
            source = [r for r in pending if r >= 0]
            input_ids[self._to_device(torch.tensor(flat))] = previous.sampled[
                self._to_device(torch.tensor(source))
            ]
        return StepInputs(
            input_ids=input_ids,
            positions=self._to_device(positions),
            metadata=metadata,
            sample_indices=self._to_device(torch.tensor(sample_rows, dtype=torch.long)),
            sample_chunks=tuple(c for c in chunks if c.sample),
            lora=self.adapters.step([c.adapter for c in chunks], lens) if self.adapters else None,
        )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        # Pinned: a copy from pageable memory can wait for the work already queued on the device.
        # One allocation per copy, unmeasured here: only steps the graphs cannot take come here.
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _validate_decode(self, chunks: Sequence[ScheduledChunk]) -> None:
        """The decode-step subset of _validate, cheap enough for every step of a large batch:
        a decode chunk's table only ever gains blocks at its end, so that end is what is new."""
        limit, size = self.num_blocks, self.block_size
        for chunk in chunks:
            table, position = chunk.block_table, chunk.start_position
            if position >= self.max_model_len or len(table) * size <= position:
                self._validate([chunk])  # the full check names the problem
            if not 0 <= table[position // size] < limit:
                raise ValueError(f"request {chunk.request_id!r}: block id out of range")
        if len({chunk.request_id for chunk in chunks}) != len(chunks):
            self._validate(chunks)

    def _validate(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Cheap checks that turn scheduler bugs into errors instead of a corrupted cache."""
        seen: set[str] = set()
        for chunk in chunks:
            if chunk.request_id in seen:
                raise ValueError(f"request {chunk.request_id!r} scheduled twice in one step")
            seen.add(chunk.request_id)
            end = chunk.start_position + chunk.num_tokens
            if chunk.num_tokens < 1 or chunk.start_position < 0:
                raise ValueError(f"request {chunk.request_id!r}: empty chunk or negative start")
            if end > self.max_model_len:
                raise ValueError(
                    f"request {chunk.request_id!r} reaches position {end - 1}, beyond the "
                    f"model's max length {self.max_model_len}"
                )
            if len(chunk.block_table) * self.block_size < end:
                raise ValueError(
                    f"request {chunk.request_id!r}: {len(chunk.block_table)} blocks of "
                    f"{self.block_size} cannot hold {end} positions"
                )
            table = chunk.block_table
            if table and (min(table) < 0 or max(table) >= self.num_blocks):
                raise ValueError(f"request {chunk.request_id!r}: block id out of range")
