"""The cuDNN SDPA graphs of the long-chunk path (cudnn_prefill.py): how each is declared and built.

Two kinds, both with the causal diagonal anchored bottom-right (a chunk's queries are the last
positions of its context):

- ragged: any number of chunks, query rows in the step's flat layout located by ragged offsets,
  the actual lengths as device tensors with a padding mask, dims bucketed to powers of two, so
  one graph serves many steps. K/V either gathered (each chunk's context copied out of the cache
  in order, located by ragged offsets too) or paged (the cache itself through block tables);
- exact: one chunk with dims equal to its query and context lengths, no mask tensors. ~10%
  faster than ragged (9.0 against 9.9 ms a layer at 32k on an H100,
  bench/results/engine_prefill/engine_cudnn_shapes_h100.json) but a graph per shape, ~40 ms to
  build: used for the shapes that repeat (cudnn_prefill.is_whole_chunk).

A graph is built with the heuristics' first plan: timing every plan on real inputs never found
a faster one (bench/results/engine_prefill/engine_prefill_long_h100_notes.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Layout:
    """What every graph of a layer's call shares: heads, dtype, the query's and output's row
    strides (the query is a view of fused QKV rows), the softmax scale."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    query_row_stride: int
    out_row_stride: int
    scale: float

    @classmethod
    def of(cls, query: torch.Tensor, key_cache: torch.Tensor, out: torch.Tensor,
           scale: float) -> Layout:  # fmt: skip
        """query and out [T, heads, head_dim]; key_cache [blocks, block_size, kv_heads, _]."""
        return cls(query.shape[1], key_cache.shape[2], query.shape[2], query.dtype,
                   query.stride(0), out.stride(0), scale)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RaggedKey:
    layout: Layout
    chunks: int
    query_bucket: int
    page_bucket: int
    cache_shape: tuple[int, ...]
    cache_stride: tuple[int, ...]
    gather: bool


@dataclass(frozen=True, slots=True)
class ExactKey:
    layout: Layout
    new: int
    context: int


@dataclass(slots=True)
class Built:
    graph: Any
    tensors: dict[str, Any]  # the graph's tensors by role, to fill its variant pack
    workspace_bytes: int


def _new_graph(cudnn: Any, handle: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    io_type = cudnn.data_type.BFLOAT16 if dtype is torch.bfloat16 else cudnn.data_type.HALF
    graph = cudnn.pygraph(
        io_data_type=io_type,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    return graph, io_type


def _index_tensor(cudnn: Any, graph: Any, name: str, dim: list[int]) -> Any:
    strides = [1] * len(dim)
    for i in range(len(dim) - 2, -1, -1):
        strides[i] = strides[i + 1] * dim[i + 1]
    return graph.tensor(name=name, dim=dim, stride=strides, data_type=cudnn.data_type.INT32)


def _query(graph: Any, layout: Layout, chunks: int, rows: int, io_type: Any) -> Any:
    """[chunks, heads, rows, head_dim] over the step's [T, heads, head_dim] query rows."""
    d, row = layout.head_dim, layout.query_row_stride
    return graph.tensor(name="q", dim=[chunks, layout.heads, rows, d],
                        stride=[rows * row, d, row, 1], data_type=io_type)  # fmt: skip


def _output(o: Any, layout: Layout, chunks: int, rows: int) -> Any:
    d, row = layout.head_dim, layout.out_row_stride
    return (
        o.set_output(True)
        .set_dim([chunks, layout.heads, rows, d])
        .set_stride([rows * row, d, row, 1])
    )


def _contiguous_kv(graph: Any, chunks: int, kv_heads: int, positions: int, head_dim: int,
                   io_type: Any) -> tuple[Any, Any]:  # fmt: skip
    """K and V as [positions, kv_heads, head_dim] rows (the gathered contexts)."""
    row = kv_heads * head_dim
    kv = {"dim": [chunks, kv_heads, positions, head_dim],
          "stride": [positions * row, head_dim, row, 1], "data_type": io_type}  # fmt: skip
    return graph.tensor(name="k", **kv), graph.tensor(name="v", **kv)


def _finish(cudnn: Any, graph: Any, key: object, tensors: dict[str, Any]) -> Built | None:
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
    except Exception as exc:  # cuDNN reports unsupported shapes as several error types
        log.warning("cuDNN has no attention plan for %s (%s): those chunks use the Triton "
                    "kernel", key, exc)  # fmt: skip
        return None
    return Built(graph, tensors, int(graph.get_workspace_size()))


def _kv_tensors(cudnn: Any, graph: Any, key: RaggedKey, block_size: int, io_type: Any,
                tensors: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:  # fmt: skip
    """K and V of a ragged graph, and the sdpa arguments of paged mode."""
    b, d = key.chunks, key.layout.head_dim
    blocks, _, kv_heads, _ = key.cache_shape
    block_stride, slot_stride, head_stride, _ = key.cache_stride
    if key.gather:
        # The gathered contexts, chunk after chunk, each located by its ragged offset.
        k, v = _contiguous_kv(graph, b, kv_heads, key.page_bucket * block_size, d, io_type)
        tensors["kv_offsets"] = _index_tensor(cudnn, graph, "kv_offsets", [b + 1, 1, 1, 1])
        k.set_ragged_offset(tensors["kv_offsets"])
        v.set_ragged_offset(tensors["kv_offsets"])
        return k, v, {}
    # The cache is [blocks, block_size, kv_heads, head_dim]; cuDNN's paged container is
    # [blocks, kv_heads, block_size, head_dim]: the same memory with two strides swapped.
    container = {
        "dim": [blocks, kv_heads, block_size, d],
        "stride": [block_stride, head_stride, slot_stride, 1],
        "data_type": io_type,
    }
    k, v = graph.tensor(name="k", **container), graph.tensor(name="v", **container)
    for name in ("table_k", "table_v"):
        tensors[name] = _index_tensor(cudnn, graph, name, [b, 1, key.page_bucket, 1])
    paged = {
        "paged_attention_k_table": tensors["table_k"],
        "paged_attention_v_table": tensors["table_v"],
        "paged_attention_max_seq_len_kv": key.page_bucket * block_size,
    }
    return k, v, paged


def build_ragged(cudnn: Any, handle: Any, key: RaggedKey, block_size: int) -> Built | None:
    layout = key.layout
    graph, io_type = _new_graph(cudnn, handle, layout.dtype)
    b, s_q = key.chunks, key.query_bucket
    q = _query(graph, layout, b, s_q, io_type)
    tensors: dict[str, Any] = {"q": q}
    tensors["q_offsets"] = _index_tensor(cudnn, graph, "q_offsets", [b + 1, 1, 1, 1])
    q.set_ragged_offset(tensors["q_offsets"])
    k, v, paged = _kv_tensors(cudnn, graph, key, block_size, io_type, tensors)
    for name in ("seq_len_q", "seq_len_kv"):
        tensors[name] = _index_tensor(cudnn, graph, name, [b, 1, 1, 1])
    o, _ = graph.sdpa(
        name="long_prefill", q=q, k=k, v=v, generate_stats=False, attn_scale=layout.scale,
        use_padding_mask=True, seq_len_q=tensors["seq_len_q"], seq_len_kv=tensors["seq_len_kv"],
        diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0,
        **paged,
    )  # fmt: skip
    tensors["o_offsets"] = _index_tensor(cudnn, graph, "o_offsets", [b + 1, 1, 1, 1])
    _output(o, layout, b, s_q).set_ragged_offset(tensors["o_offsets"])
    tensors.update({"k": k, "v": v, "o": o})
    return _finish(cudnn, graph, key, tensors)


def build_exact(cudnn: Any, handle: Any, key: ExactKey) -> Built | None:
    layout = key.layout
    graph, io_type = _new_graph(cudnn, handle, layout.dtype)
    q = _query(graph, layout, 1, key.new, io_type)
    k, v = _contiguous_kv(graph, 1, layout.kv_heads, key.context, layout.head_dim, io_type)
    o, _ = graph.sdpa(name="exact_prefill", q=q, k=k, v=v, generate_stats=False,
                      attn_scale=layout.scale,
                      diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                      diagonal_band_right_bound=0)  # fmt: skip
    _output(o, layout, 1, key.new)
    return _finish(cudnn, graph, key, {"q": q, "k": k, "v": v, "o": o})
