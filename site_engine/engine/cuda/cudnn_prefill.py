"""Long prompt chunks through cuDNN's fused attention, reading the paged cache in place.

Why a second kernel: at head_dim 64 the varlen Triton kernel (paged_prefill.py) runs a long
prompt's attention at ~60% of the speed of cuDNN's Hopper SDPA kernel, the one torch's SDPA (and
so a transformers forward) picks on an H100: 11.4 against 8.7 ms a layer for a 32k-token prompt
(bench/results/engine_prefill_long_h100_notes.md). Triton cannot issue the asynchronous
warpgroup MMAs that let cuDNN overlap the exponentials with the tensor cores. torch exposes
cuDNN's kernel only with the causal diagonal anchored top-left, which is wrong for a chunk that
continues cached positions; cudnn-frontend's graph API (the `nvidia-cudnn-frontend` package, on
the cuDNN library torch already loads) exposes what a chunked prefill needs: the diagonal
anchored bottom-right, K/V read through page tables (the engine's own cache and block tables, no
gathered copy), ragged query and output rows (the step's flat layout), and the actual query and
KV lengths as device tensors.

cuDNN builds a graph for fixed dimensions. The lengths, offsets and tables are tensors, so one
graph serves every step with the same number of long chunks, query rows up to a power-of-two
bucket and KV pages up to another; graphs are built on first use (cuDNN's kernels are
precompiled: a build costs milliseconds) and kept.

Only chunks of at least `min_tokens` query tokens take this path; the rest of the step (shorter
chunks, decode rows) stays on the Triton kernels, which skip the long chunks. A step with a long
chunk runs eagerly (not from a captured step graph): its shapes change with every chunk, and at
thousands of tokens the launch overhead is noise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from site_engine.engine.attention import AttentionMetadata

log = logging.getLogger(__name__)

# Which chunks cuDNN takes: at least 4,096 new tokens ending at 8,192 positions or more. A step
# with such a chunk runs eagerly, which costs its host 2-3 ms more than a graph replay; below
# these sizes cuDNN's faster attention does not pay for that (engine prefill of 2k-32k-token
# prompts on an H100 with each rule, random-weight model and prompts, never the held-out data:
# bench/results/engine_prefill_long_h100_notes.md).
DEFAULT_MIN_TOKENS = 4096
DEFAULT_MIN_CONTEXT = 8192
_MIN_QUERY_BUCKET = 256
_MIN_PAGE_BUCKET = 64
# cuDNN 9.7 is the first to take paged K/V together with ragged queries.
_MIN_BACKEND_VERSION = 90700


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


def _next_power_of_two(value: int, floor: int) -> int:
    bucket = floor
    while bucket < value:
        bucket *= 2
    return bucket


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
        kv_starts=fields[3].view(count + 1, 1, 1, 1) if gather else None,
    )


@dataclass(frozen=True, slots=True)
class _GraphKey:
    chunks: int
    query_bucket: int
    page_bucket: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    query_row_stride: int
    out_row_stride: int
    cache_shape: tuple[int, ...]
    cache_stride: tuple[int, ...]
    scale: float
    gather: bool


@dataclass(slots=True)
class _Built:
    graph: Any
    tensors: dict[str, Any]
    workspace_bytes: int


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
        self._graphs: dict[_GraphKey, _Built | None] = {}

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
        plan for this shape, so the caller runs them through the Triton kernel."""
        key = _GraphKey(
            chunks=len(plan.rows), query_bucket=plan.query_bucket, page_bucket=plan.page_bucket,
            heads=query.shape[1], kv_heads=key_cache.shape[2], head_dim=query.shape[2],
            dtype=query.dtype, query_row_stride=query.stride(0), out_row_stride=out.stride(0),
            cache_shape=tuple(key_cache.shape), cache_stride=tuple(key_cache.stride()),
            scale=scale, gather=self.gather,
        )  # fmt: skip
        built = self._graphs.get(key, ...)
        if built is ...:
            built = self._build(key, key_cache.shape[1])
            self._graphs[key] = built
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

    def _stream_handle(self) -> Any:
        cudnn = self._cudnn
        if self._handle is None:
            self._handle = cudnn.create_handle()
        cudnn.set_stream(handle=self._handle, stream=torch.cuda.current_stream().cuda_stream)
        return self._handle

    def _build(self, key: _GraphKey, block_size: int) -> _Built | None:
        cudnn = self._cudnn
        io_type = cudnn.data_type.BFLOAT16 if key.dtype is torch.bfloat16 else (
            cudnn.data_type.HALF)  # fmt: skip
        graph = cudnn.pygraph(
            io_data_type=io_type,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=self._stream_handle(),
        )
        b, s_q, d = key.chunks, key.query_bucket, key.head_dim

        def index_tensor(name: str, dim: list[int]) -> Any:
            strides = [1] * len(dim)
            for i in range(len(dim) - 2, -1, -1):
                strides[i] = strides[i + 1] * dim[i + 1]
            return graph.tensor(name=name, dim=dim, stride=strides,
                                data_type=cudnn.data_type.INT32)  # fmt: skip

        q = graph.tensor(name="q", dim=[b, key.heads, s_q, d],
                         stride=[s_q * key.query_row_stride, d, key.query_row_stride, 1],
                         data_type=io_type)  # fmt: skip
        q_offsets = index_tensor("q_offsets", [b + 1, 1, 1, 1])
        q.set_ragged_offset(q_offsets)
        blocks, _, kv_heads, _ = key.cache_shape
        block_stride, slot_stride, head_stride, _ = key.cache_stride
        tensors: dict[str, Any] = {}
        paged: dict[str, Any] = {}
        if key.gather:
            # The gathered contexts are [positions, kv_heads, head_dim] rows, chunk after chunk.
            s_kv, row = key.page_bucket * block_size, kv_heads * d
            gathered = {"dim": [b, kv_heads, s_kv, d], "stride": [s_kv * row, d, row, 1],
                        "data_type": io_type}  # fmt: skip
            k = graph.tensor(name="k", **gathered)
            v = graph.tensor(name="v", **gathered)
            tensors["kv_offsets"] = index_tensor("kv_offsets", [b + 1, 1, 1, 1])
            k.set_ragged_offset(tensors["kv_offsets"])
            v.set_ragged_offset(tensors["kv_offsets"])
        else:
            # The cache is [blocks, block_size, kv_heads, head_dim]; cuDNN's paged container is
            # [blocks, kv_heads, block_size, head_dim]: the same memory with two strides swapped.
            container = {"dim": [blocks, kv_heads, block_size, d],
                         "stride": [block_stride, head_stride, slot_stride, 1],
                         "data_type": io_type}  # fmt: skip
            k = graph.tensor(name="k", **container)
            v = graph.tensor(name="v", **container)
            tensors["table_k"] = index_tensor("table_k", [b, 1, key.page_bucket, 1])
            tensors["table_v"] = index_tensor("table_v", [b, 1, key.page_bucket, 1])
            paged = {
                "paged_attention_k_table": tensors["table_k"],
                "paged_attention_v_table": tensors["table_v"],
                "paged_attention_max_seq_len_kv": key.page_bucket * block_size,
            }
        seq_len_q = index_tensor("seq_len_q", [b, 1, 1, 1])
        seq_len_kv = index_tensor("seq_len_kv", [b, 1, 1, 1])
        o, _ = graph.sdpa(
            name="long_prefill",
            q=q, k=k, v=v,
            generate_stats=False,
            attn_scale=key.scale,
            use_padding_mask=True,
            seq_len_q=seq_len_q,
            seq_len_kv=seq_len_kv,
            diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
            diagonal_band_right_bound=0,
            **paged,
        )  # fmt: skip
        o_offsets = index_tensor("o_offsets", [b + 1, 1, 1, 1])
        o.set_output(True).set_dim([b, key.heads, s_q, d]).set_stride(
            [s_q * key.out_row_stride, d, key.out_row_stride, 1]
        ).set_ragged_offset(o_offsets)
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            # The heuristics' first plan: timing every plan on the step's inputs never found
            # a faster one (bench/results/engine_cudnn_shapes_h100.md).
            graph.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
        except Exception as exc:  # cuDNN reports unsupported shapes as several error types
            log.warning("cuDNN has no attention plan for %s (%s): those chunks use the Triton "
                        "kernel", key, exc)  # fmt: skip
            return None
        tensors.update({"q": q, "k": k, "v": v, "o": o, "q_offsets": q_offsets,
                        "o_offsets": o_offsets, "seq_len_q": seq_len_q,
                        "seq_len_kv": seq_len_kv})  # fmt: skip
        return _Built(graph, tensors, int(graph.get_workspace_size()))
