"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a 1B model issues hundreds of small kernels; launched from Python they cost
far more than the ~1 ms the GPU needs to read the weights. Each bucket's whole forward pass
(embedding, every layer with the paged Triton attention, final norm, lm_head) is captured once
over static input buffers; a step copies its inputs into those buffers and replays the graph.
A batch is padded up to its bucket with rows that attend to, and write into, a scratch block
that no sequence owns.

A step's rows come from the running batch the model runner keeps (input_batch.py): the host
stages one small array per step (row, position, KV slot, context length, LoRA slot of each row),
and the rows' input tokens (each row's last sampled token) and block tables are gathered on the
device from the batch's, so a step of 1,024 rows costs the host a few numpy copies. With async
scheduling the host writes step N+1's inputs while step N may still be copying its own: the
pinned staging buffers alternate between two sets, and a set is reused only two steps later,
after the engine has waited for the step that used it.

Every bucket's graph writes its float32 logits into one static buffer (`logits_out`, shared with
the flat step graphs): were each graph to keep its own output, the outputs alone would hold
(sum of the bucket sizes) x vocabulary x 4 bytes, 3.3 GB for 1,024 sequences and a 128k
vocabulary. The sampler reads a step's logits before the next step's replay writes them (one
stream), so one buffer serves every step.

With LoRA slots, each graph also runs the segmented LoRA kernels over a static slot-index buffer
(one entry per row, -1: no adapter, as for padding rows) that `run` writes from the staging copy,
and over the slots' stacked A/B tensors, which adapters are written into in place. Inside a graph
a step's layout is data, so the LoRA kernels launch even when no row has an adapter (~256 nearly
empty launches a step of a 32-layer model, ~0.8 ms on an H200): each bucket therefore also keeps
a graph of the base model alone, replayed for steps whose rows have no adapter (`base_only`).
Both sets share one memory pool (never replayed at once; the base graph's allocations are a
subset of the LoRA graph's), so the second set costs its instantiated graphs, not activations.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from site_engine.engine.attention import AttentionBackend, AttentionMetadata
from site_engine.engine.core.graph_capture import PendingGraph, lazy_order
from site_engine.engine.input_batch import InputBatch, StepLayout
from site_engine.engine.kv_cache import PagedKVCache
from site_engine.engine.lora.slots import LoraSlots
from site_engine.engine.models import FlatCausalLM

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448,
            512, 640, 768, 896, 1024)  # fmt: skip


def capture_buckets(
    sizes: Sequence[int], forward: Callable[[int], torch.Tensor], pool: Any = None
) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
    """One CUDA graph of `forward(size)` per size, with its output tensor; largest first so the
    smaller ones reuse its memory pool. Two eager warm-ups first (Triton compiles, cuBLAS picks
    its kernels) on a side stream, as capture requires.

    Warm-ups and captures all run on one side stream per device, kept for the process: cuBLAS
    keeps a workspace per stream it ever ran on (tens of MiB each, never freed), so a fresh
    stream per graph would leave up to one workspace per pooled stream behind (~1 GiB) that no
    memory trial sees. `pool`: another capture's memory pool to share (what the graphs of both
    captures allocate inside must never be live at once: they are replayed one after another)."""
    captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    for size in sorted(sizes, reverse=True):
        graph, output = capture_one(size, forward, pool)
        pool = graph.pool()
        captured[size] = (graph, output)
    torch.cuda.synchronize()
    return captured


def capture_one(
    size: int, forward: Callable[[int], torch.Tensor], pool: Any = None, lazy: bool = False
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """capture_buckets for one size. `lazy`: a capture between steps of a serving engine
    (EngineConfig.lazy_graphs), which waits for the capture to finish and checks only this
    thread's calls ("thread_local"): another thread of the site (an adapter's or a grammar's)
    may touch the device meanwhile, on a stream of its own, which "global" would refuse."""
    stream = _capture_stream()
    if lazy:
        # The eager steps before it left activations cached in the default pool, which the
        # graph's private pool cannot reuse: handed back, the two need not be held at once.
        torch.cuda.empty_cache()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward(size)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    mode = "thread_local" if lazy else "global"
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=mode):
        output = forward(size)
    if lazy:
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    return graph, output


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    return _CAPTURE_STREAMS[device]


def bucket_sizes(max_batch: int, only_largest: bool = False) -> tuple[int, ...]:
    """The batch sizes captured; `only_largest`: the largest alone (what a memory trial needs:
    the smaller graphs share its memory pool)."""
    if only_largest:
        return (max_batch,)
    sizes = [b for b in _BUCKETS if b < max_batch]
    return (*sizes, max_batch)


def base_only(lora_slots: npt.NDArray[np.int64] | None) -> bool:
    """Whether a step's rows use no adapter (no slots, or every one -1): such a step replays
    the graph of the base model alone."""
    return lora_slots is None or not bool((lora_slots >= 0).any())


def release_graphs(graphs: Sequence[torch.cuda.CUDAGraph]) -> None:
    """Frees captured graphs (their instantiated form and their hold on the memory pool)."""
    for graph in graphs:
        graph.reset()


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class DecodeGraphs:
    def __init__(
        self,
        model: FlatCausalLM,
        attention: AttentionBackend,
        kv_cache: PagedKVCache,
        *,
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        logits_out: torch.Tensor | None = None,
        only_largest: bool = False,
        lora: LoraSlots | None = None,
        capture: bool = True,
    ) -> None:
        """logits_out: [>= max_batch, vocab] float32 that every graph writes its logits into
        (allocated here when not given). lora: the adapter slots rows may use (run's
        `token_slots`). Without `capture` (CPU tests, under Triton's interpreter) every step
        runs the same static-buffer forward eagerly."""
        self._model, self._attention, self._kv_cache = model, attention, kv_cache
        self._lora = lora
        self.buckets = bucket_sizes(max_batch, only_largest)
        self._max_blocks = max_blocks_per_seq
        self._scratch_block = scratch_block
        self._block_size = kv_cache.block_size
        device = kv_cache.device
        self._input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._slots = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self._lora_slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self._block_tables = torch.full(
            (max_batch, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )
        # Pinned host staging (row, position, slot, context length, LoRA slot): a single copy
        # per step; two sets, alternated (see the module docstring). The rows' tables and last
        # tokens are gathered on the device from the running batch's (input_batch.py).
        self._capture = capture
        pin = device.type == "cuda"
        self._host = [
            torch.zeros((max_batch, 5), dtype=torch.long, pin_memory=pin) for _ in range(2)
        ]
        self._turn = 0
        self._staged = torch.zeros((max_batch, 5), dtype=torch.long, device=device)
        if logits_out is None:
            vocab = int(model.vocab_size)
            logits_out = torch.empty((max_batch, vocab), dtype=torch.float32, device=device)
        self._logits_out = logits_out
        self._captured: dict[int, _Captured] = {}
        self._base_captured: dict[int, _Captured] = {}  # LoRA engines only (base_only steps)
        self._pool: Any = None  # lazy captures' shared memory pool, once the first exists

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._slots[:batch],
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32,
                                         device=self._slots.device),
            context_lens=self._context_lens[:batch],
            block_tables=self._block_tables[:batch],
            max_query_len=1,
            max_context_len=self._max_blocks * self._block_size,
            query_start_loc_host=tuple(range(batch + 1)),
            context_lens_host=(1,) * batch,
        )  # fmt: skip

    def _forward(self, batch: int, metadata: AttentionMetadata, lora: bool = True) -> torch.Tensor:
        self._attention.prepare(metadata)
        slots = self._lora if lora else None
        if slots is not None:
            # Built inside the capture: the kernels' tiles come from the static buffer.
            self._model.lora = slots.step(self._lora_slots[:batch])  # type: ignore[attr-defined]
        try:
            hidden = self._model.forward(
                self._input_ids[:batch], self._positions[:batch], self._kv_cache, metadata
            )
        finally:
            if slots is not None:
                self._model.lora = None  # type: ignore[attr-defined]
        return self._model.compute_logits(hidden, out=self._logits_out[:batch])

    @torch.inference_mode()
    def capture(self) -> None:
        if not self._capture:
            return
        self._reset_padding(0)
        metadata = {batch: self._metadata(batch) for batch in self.buckets}
        captured = capture_buckets(self.buckets, lambda b: self._forward(b, metadata[b]))
        for batch, (graph, logits) in captured.items():
            self._captured[batch] = _Captured(graph, logits)
        if self._lora is None:
            return
        pool = captured[self.buckets[-1]][0].pool()
        base = capture_buckets(self.buckets, lambda b: self._forward(b, metadata[b], False),
                               pool=pool)  # fmt: skip
        for batch, (graph, logits) in base.items():
            self._base_captured[batch] = _Captured(graph, logits)

    def pending(self) -> list[PendingGraph]:
        """What `capture` would capture, one graph per callable (lazy graphs: captured between
        steps), in `lazy_order`; a LoRA engine's base-only graph of a size after its LoRA one."""
        if not self._capture:
            return []
        pending: list[PendingGraph] = []
        for batch in lazy_order(self.buckets):
            pending.append(PendingGraph(f"decode {batch}", partial(self._capture_lazy, batch)))
            if self._lora is not None:
                capture = partial(self._capture_lazy, batch, lora=False)
                pending.append(PendingGraph(f"decode {batch} base", capture))
        return pending

    @torch.inference_mode()
    def _capture_lazy(self, batch: int, lora: bool = True) -> None:
        # The static inputs still hold the last step's rows: its warm-ups would write their
        # K/V again (into blocks that may be another sequence's by now). Padding rows write
        # into the scratch block only.
        self._reset_padding(0)
        metadata = self._metadata(batch)
        graph, logits = capture_one(
            batch, lambda b: self._forward(b, metadata, lora), self._pool, lazy=True
        )
        self._pool = graph.pool()
        (self._captured if lora else self._base_captured)[batch] = _Captured(graph, logits)

    def ready(self, count: int) -> bool:
        """Whether a decode step of `count` rows has its graph (lazy graphs: not yet, maybe)."""
        if count > self.max_batch:
            return False
        if not self._capture:
            return True
        return self.buckets[bisect.bisect_left(self.buckets, count)] in self._captured

    @property
    def num_graphs(self) -> int:
        return len(self._captured) + len(self._base_captured)

    def close(self) -> None:
        every = (*self._captured.values(), *self._base_captured.values())
        release_graphs([captured.graph for captured in every])
        self._captured.clear()
        self._base_captured.clear()

    def _reset_padding(self, start: int) -> None:
        scratch_slot = self._scratch_block * self._block_size
        self._input_ids[start:].zero_()
        self._positions[start:].zero_()
        self._slots[start:].fill_(scratch_slot)
        self._context_lens[start:].fill_(1)
        self._lora_slots[start:].fill_(-1)
        self._block_tables[start:, 0].fill_(self._scratch_block)

    def run(self, layout: StepLayout, batch: InputBatch) -> torch.Tensor:
        """float32 logits [decode rows, vocab] of the layout's decode rows (its first
        `num_decodes` entries, one token each), whose input tokens are their rows' last tokens
        on the device (`batch.last_token`) and whose tables are `batch`'s."""
        lora_slots = layout.lora_slots
        if lora_slots is not None and self._lora is None:
            raise ValueError("LoRA rows in a step, but the decode graphs have no LoRA slots")
        count = layout.num_decodes
        batch_size = self.buckets[bisect.bisect_left(self.buckets, count)]
        self._turn ^= 1
        host_t = self._host[self._turn]
        host = host_t.numpy()
        # One pinned copy per step: row, position, slot, context length, LoRA slot per row.
        host[:count, 0] = layout.rows[:count]
        host[:count, 1] = layout.positions[:count]
        host[:count, 2] = layout.slots[:count]
        host[:count, 3] = layout.context_lens[:count]
        host[:count, 4] = -1 if lora_slots is None else lora_slots[:count]
        staged = self._staged[:count]
        staged.copy_(host_t[:count], non_blocking=True)
        rows = staged[:, 0]
        torch.index_select(batch.last_token, 0, rows, out=self._input_ids[:count])
        self._positions[:count] = staged[:, 1]
        self._slots[:count] = staged[:, 2]
        self._context_lens[:count] = staged[:, 3].to(torch.int32)
        widest = layout.widest
        self._block_tables[:count, :widest] = batch.tables_dev[:, :widest].index_select(0, rows)
        if self._lora is not None:  # a base-only engine's graphs read no slot buffer
            self._lora_slots[:count] = staged[:, 4]
        if count < batch_size:
            self._reset_padding(count)
        if not self._capture:  # the same computation, eagerly
            logits = self._forward(
                batch_size, self._metadata(batch_size), not base_only(lora_slots)
            )
            return logits[:count]
        # Lazy graphs: a size's base-only graph may not exist yet where its LoRA one does; the
        # LoRA graph computes the same for rows of slot -1.
        captured = self._base_captured.get(batch_size) if base_only(lora_slots) else None
        if captured is None:
            captured = self._captured[batch_size]
        captured.graph.replay()
        return captured.logits[:count]
