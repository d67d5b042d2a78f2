"""Long prompt chunks through cuDNN's fused attention.

Why a second kernel: at head_dim 64 the varlen Triton kernel (paged_prefill.py) runs a long
prompt's attention at ~60% of the speed of cuDNN's Hopper SDPA kernel, the one torch's SDPA (and
so a transformers forward) picks on an H100: 11.4 against 8.7 ms a layer for a 32k-token prompt
(bench/results/engine_prefill/engine_prefill_long_h100_notes.md). Triton cannot issue the
asynchronous warpgroup MMAs that let cuDNN overlap the exponentials with the tensor cores. torch
exposes cuDNN's kernel only with the causal diagonal anchored top-left, which is wrong for a chunk
that continues cached positions; cudnn-frontend's graph API (the `nvidia-cudnn-frontend` package, on
the cuDNN library torch already loads) exposes what a chunked prefill needs: the diagonal anchored
bottom-right, ragged query and output rows (the step's flat layout), the actual query and KV lengths
as device tensors, and K/V either read through page tables or gathered. Gathered is the default:
each layer copies the chunks' contexts out of the cache in order (66 MB of K and V at 32k positions
with 8 KV heads of 64; at most ~0.5 GB for two 128k contexts, inside the memory plan's reserve), and
cuDNN's paged mode is slower with the engine's 16-token blocks (12.6 against 9.9 ms a layer at 32k).

cuDNN builds a graph for fixed dimensions (~40 ms a graph; cudnn_graphs.py declares them). The
lengths, offsets and tables are tensors, so one ragged graph serves every step with the same
number of long chunks, query rows up to a power-of-two bucket and KV pages up to another; the
full chunks of a long prompt prefilled alone, whose shapes repeat, get graphs of their exact
dims, ~10% faster. Graphs are built on first use and kept.

Only chunks of at least `min_tokens` query tokens take this path; the rest of the step (shorter
chunks, decode rows) stays on the Triton kernels, which skip the long chunks. A step with a long
chunk runs eagerly (not from a captured step graph): its shapes change with every chunk, and at
thousands of tokens the launch overhead is noise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from site_engine.engine.attention import AttentionMetadata
from site_engine.engine.cuda.cudnn_graphs import (
    Built,
    ExactKey,
    Layout,
    RaggedKey,
    build_exact,
    build_ragged,
)

log = logging.getLogger(__name__)

# Which chunks cuDNN takes: at least 4,096 new tokens ending at 8,192 positions or more. A step
# with such a chunk runs eagerly, which costs its host 2-3 ms more than a graph replay; below
# these sizes cuDNN's faster attention does not pay for that (engine prefill of 2k-32k-token
# prompts on an H100 with each rule, random-weight model and prompts, never the held-out data:
# bench/results/engine_prefill/engine_prefill_long_h100_notes.md).
DEFAULT_MIN_TOKENS = 4096
DEFAULT_MIN_CONTEXT = 8192
_MIN_QUERY_BUCKET = 256
_MIN_PAGE_BUCKET = 64
# cuDNN 9.7 is the first to take paged K/V together with ragged queries.
_MIN_BACKEND_VERSION = 90700
# The ragged offsets and page tables handed to cuDNN are int32 (_index_tensor in
# cudnn_graphs.py), and how cuDNN indexes a paged container past 2^31 elements is not
# documented: a plan whose element offsets reach this goes to the Triton kernel, 64-bit
# throughout (docs/engine-gpu.md, "KV offsets").
_INT32_ELEMENTS = 1 << 31


@dataclass(frozen=True, slots=True)
class LongChunkPlan:
    """A step's long chunks, as cuDNN reads them (built once per step, used by every layer)."""

    rows: tuple[int, ...]  # the chunks' sequence indices in the flat batch
    query_starts: torch.Tensor  # [B + 1, 1, 1, 1] int32: first query row of each chunk
    seq_len_q: torch.Tensor  # [B, 1, 1, 1] int32
    seq_len_kv: torch.Tensor  # [B, 1, 1, 1] int32
    tables: torch.Tensor  # [B, 1, pages, 1] int32: each chunk's block table, padded with 0
    # Gathered mode: the blocks of every chunk's context, in order and chunk after chunk, and
    # where each chunk's positions start among them ([B + 1, 1, 1, 1] int32, in tokens).
    gather_blocks: torch.Tensor | None
    kv_starts: torch.Tensor | None
    query_bucket: int
    page_bucket: int
    min_tokens: int
    min_context: int
    # (first query row, new tokens, context length) of each chunk, on the host.
    shapes: tuple[tuple[int, int, int], ...] = ()


def int32_offsets_fit(
    plan: LongChunkPlan, query: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
    gather: bool,
) -> bool:  # fmt: skip
    """Whether every element offset cuDNN would compute for `plan` stays below 2^31: the
    queries' and outputs' ragged offsets (a chunk's last row x the row stride), the gathered
    contexts' (all their positions x kv_heads x head_dim) or, in paged mode, the cache's."""
    block_size = key_cache.shape[1]
    rows_end = max(start + new for start, new, _ in plan.shapes)
    if rows_end * max(query.stride(0), out.stride(0)) >= _INT32_ELEMENTS:
        return False
    if not gather:
        return key_cache.shape[0] * key_cache.stride(0) < _INT32_ELEMENTS
    positions = sum(-(-context // block_size) * block_size for _, _, context in plan.shapes)
    return positions * key_cache.stride(1) < _INT32_ELEMENTS


def _next_power_of_two(value: int, floor: int) -> int:
    bucket = floor
    while bucket < value:
        bucket *= 2
    return bucket


def is_whole_chunk(new: int, context: int) -> bool:
    """A chunk whose query and context lengths are multiples of 1,024: the full chunks a long
    prompt is cut into when it prefills without decode rows beside it (k x the step budget).
    Such shapes repeat, so they get graphs of their exact dims (cudnn_graphs.build_exact);
    every other shape would cost a ~40 ms build, most of them once."""
    return new % 1024 == 0 and context % 1024 == 0


def plan_long_chunks(
    metadata: AttentionMetadata,
    min_tokens: int,
    min_context: int,
    block_size: int,
    gather: bool = False,
) -> LongChunkPlan | None:
    """The step's chunks of at least `min_tokens` query tokens that end at `min_context`
    positions or more, or None when it has none."""
    starts, contexts = metadata.query_start_loc_host, metadata.context_lens_host
    rows = tuple(
        i
        for i in range(len(contexts))
        if starts[i + 1] - starts[i] >= min_tokens and contexts[i] >= min_context
    )
    if not rows:
        return None
    lens_q = [starts[i + 1] - starts[i] for i in rows]
    lens_kv = [contexts[i] for i in rows]
    pages = [-(-n // block_size) for n in lens_kv]
    page_bucket = _next_power_of_two(max(pages), _MIN_PAGE_BUCKET)
    device = metadata.block_tables.device
    kv_starts = [0]
    for count in pages:
        kv_starts.append(kv_starts[-1] + count * block_size)
    count = len(rows)
    flat = [i * page_bucket + p for i, n in enumerate(pages) for p in range(n)] if gather else []
    # Everything the device needs in one pinned buffer and one copy: a copy from pageable
    # memory would wait for the work already queued.
    host = torch.tensor(
        [starts[i] for i in rows] + [starts[rows[-1] + 1]] + [*lens_q, 0] + [*lens_kv, 0]
        + kv_starts + list(rows) + flat,
        dtype=torch.int32,
    )  # fmt: skip
    if device.type == "cuda":
        host = host.pin_memory()
    values = host.to(device, non_blocking=True)
    fields = values[: 4 * (count + 1)].view(4, count + 1)
    index = values[4 * (count + 1) : 4 * (count + 1) + count]
    width = min(metadata.block_tables.shape[1], page_bucket)
    tables = torch.zeros((count, page_bucket), dtype=torch.int32, device=device)
    tables[:, :width] = metadata.block_tables.index_select(0, index)[:, :width]
    gather_blocks = None
    if gather:
        gather_blocks = tables.view(-1).index_select(0, values[4 * (count + 1) + count :])
    return LongChunkPlan(
        rows=rows,
        # The ragged offsets of the chunks' queries are contiguous only if the chunks are
        # adjacent in the batch; each chunk's own start is what cuDNN needs (the end entry
        # bounds the last one).
        query_starts=fields[0].view(count + 1, 1, 1, 1),
        seq_len_q=fields[1, :count].view(count, 1, 1, 1),
        seq_len_kv=fields[2, :count].view(count, 1, 1, 1),
        tables=tables.view(count, 1, page_bucket, 1),
        query_bucket=_next_power_of_two(max(lens_q), _MIN_QUERY_BUCKET),
        page_bucket=page_bucket,
        min_tokens=min_tokens,
        min_context=min_context,
        gather_blocks=gather_blocks,
        shapes=tuple((starts[i], n, c) for i, n, c in zip(rows, lens_q, lens_kv, strict=True)),
        kv_starts=fields[3].view(count + 1, 1, 1, 1) if gather else None,
    )


class CudnnLongPrefill:
    """Builds, keeps and runs the cuDNN graphs of a step's long chunks."""

    def __init__(
        self,
        cudnn_module: Any,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        min_context: int = DEFAULT_MIN_CONTEXT,
        gather: bool = True,
    ) -> None:
        self._cudnn = cudnn_module
        self.min_tokens = min_tokens
        self.min_context = min_context
        self.gather = gather
        self._handle: Any = None
        self._graphs: dict[RaggedKey | ExactKey, Built | None] = {}

    @classmethod
    def create(
        cls,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        min_context: int = DEFAULT_MIN_CONTEXT,
        gather: bool = True,
    ) -> CudnnLongPrefill | None:
        """None where cudnn-frontend is missing or the cuDNN library is older than 9.7."""
        try:
            import cudnn

            version = int(cudnn.backend_version())
        except (ImportError, OSError, RuntimeError) as exc:  # missing, or no libcudnn found
            log.info("no cuDNN frontend (%s): long prompt chunks use the Triton kernel", exc)
            return None
        if version < _MIN_BACKEND_VERSION:
            log.info("cuDNN %s is older than 9.7: long prompt chunks use the Triton kernel",
                     version)  # fmt: skip
            return None
        return cls(cudnn, min_tokens, min_context, gather)

    def describe(self) -> str:
        version = int(self._cudnn.backend_version())
        return (
            f"cuDNN {version // 10000}.{version // 100 % 100} fused attention for chunks of "
            f">= {self.min_tokens:,} tokens at >= {self.min_context:,} positions (eager steps)"
        )

    def close(self) -> None:
        """Drops the built graphs and destroys the cuDNN handle (engine shutdown)."""
        self._graphs.clear()
        if self._handle is not None:
            self._cudnn.destroy_handle(self._handle)
            self._handle = None

    @property
    def num_graphs(self) -> int:
        return sum(built is not None for built in self._graphs.values())

    def supports(
        self, query: torch.Tensor, key_cache: torch.Tensor, sliding_window: int | None
    ) -> bool:
        """cuDNN's SDPA takes half-precision inputs and head dims that are multiples of 8 up to
        128; the engine's sliding windows stay on the Triton kernel."""
        head_dim = query.shape[-1]
        return (
            query.is_cuda
            and query.dtype in (torch.bfloat16, torch.float16)
            and key_cache.dtype == query.dtype
            and head_dim % 8 == 0
            and head_dim <= 128
            and sliding_window is None
            and query.stride(-1) == 1
            and key_cache.stride(-1) == 1
        )

    def plan(self, metadata: AttentionMetadata, block_size: int) -> LongChunkPlan | None:
        return plan_long_chunks(metadata, self.min_tokens, self.min_context, block_size,
                                self.gather)  # fmt: skip

    def takes(self, query_tokens: int, context_len: int) -> bool:
        """Whether a chunk of `query_tokens` new tokens ending at `context_len` positions is
        long enough for this path."""
        return query_tokens >= self.min_tokens and context_len >= self.min_context

    def run(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        plan: LongChunkPlan,
        *,
        scale: float,
    ) -> bool:
        """Writes the long chunks' rows of `out`; False (nothing written) when cuDNN has no
        plan for this shape, or its int32 offsets could not reach every element, so the caller
        runs them through the Triton kernel."""
        if not int32_offsets_fit(plan, query, out, key_cache, self.gather):
            return False
        if self.gather and len(plan.shapes) == 1 and is_whole_chunk(*plan.shapes[0][1:]):
            return self._run_exact(query, key_cache, value_cache, out, plan, scale)
        return self._run_ragged(query, key_cache, value_cache, out, plan, scale)

    def _run_ragged(self, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, out: torch.Tensor, plan: LongChunkPlan,
                    scale: float) -> bool:  # fmt: skip
        """Any chunks through a ragged graph (cudnn_graphs.build_ragged)."""
        key = RaggedKey(
            Layout.of(query, key_cache, out, scale), chunks=len(plan.rows),
            query_bucket=plan.query_bucket, page_bucket=plan.page_bucket,
            cache_shape=tuple(key_cache.shape), cache_stride=tuple(key_cache.stride()),
            gather=self.gather,
        )  # fmt: skip
        built = self._graph(key, lambda handle: build_ragged(self._cudnn, handle, key,
                                                             key_cache.shape[1]))  # fmt: skip
        if built is None:
            return False
        handle = self._stream_handle()
        tensors = built.tensors
        workspace = torch.empty(max(built.workspace_bytes, 1), dtype=torch.uint8,
                                device=query.device)  # fmt: skip
        # Ragged offsets count elements from the tensor's start.
        pack = {
            tensors["q"]: query,
            tensors["o"]: out,
            tensors["q_offsets"]: plan.query_starts * query.stride(0),
            tensors["o_offsets"]: plan.query_starts * out.stride(0),
            tensors["seq_len_q"]: plan.seq_len_q,
            tensors["seq_len_kv"]: plan.seq_len_kv,
        }
        if plan.gather_blocks is not None and plan.kv_starts is not None:
            # The contexts' blocks copied out in order: [positions, kv_heads, head_dim] rows.
            row = key_cache.shape[2] * key_cache.shape[3]
            pack[tensors["k"]] = key_cache.index_select(0, plan.gather_blocks)
            pack[tensors["v"]] = value_cache.index_select(0, plan.gather_blocks)
            pack[tensors["kv_offsets"]] = plan.kv_starts * row
        else:
            pack[tensors["k"]] = key_cache
            pack[tensors["v"]] = value_cache
            pack[tensors["table_k"]] = plan.tables
            pack[tensors["table_v"]] = plan.tables
        built.graph.execute(pack, workspace, handle=handle)
        return True

    def _run_exact(self, query: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, out: torch.Tensor, plan: LongChunkPlan,
                   scale: float) -> bool:  # fmt: skip
        """One whole chunk (is_whole_chunk) through a graph of its exact dims
        (cudnn_graphs.build_exact); a shape cuDNN refuses goes the ragged way."""
        start, new, context = plan.shapes[0]
        assert plan.gather_blocks is not None
        key = ExactKey(Layout.of(query, key_cache, out, scale), new, context)
        built = self._graph(key, lambda handle: build_exact(self._cudnn, handle, key))
        if built is None:
            return self._run_ragged(query, key_cache, value_cache, out, plan, scale)
        rows = slice(start, start + new)
        tensors = built.tensors
        pack = {
            tensors["q"]: query[rows],
            tensors["o"]: out[rows],
            tensors["k"]: key_cache.index_select(0, plan.gather_blocks),
            tensors["v"]: value_cache.index_select(0, plan.gather_blocks),
        }
        workspace = torch.empty(max(built.workspace_bytes, 1), dtype=torch.uint8,
                                device=query.device)  # fmt: skip
        built.graph.execute(pack, workspace, handle=self._stream_handle())
        return True

    def _graph(
        self, key: RaggedKey | ExactKey, build: Callable[[Any], Built | None]
    ) -> Built | None:
        """The graph of `key`, built on first use (None: cuDNN has no plan for it, also kept)."""
        if key not in self._graphs:
            self._graphs[key] = build(self._stream_handle())
        return self._graphs[key]

    def _stream_handle(self) -> Any:
        cudnn = self._cudnn
        if self._handle is None:
            self._handle = cudnn.create_handle()
        cudnn.set_stream(handle=self._handle, stream=torch.cuda.current_stream().cuda_stream)
        return self._handle
