"""Long chunks through cuDNN (cudnn_prefill.py) inside the CUDA backend's step, against a float64
reference on random scattered caches.

Each case mixes long chunks (fresh prompts and chunks that continue cached positions), short
chunks and decode rows in one flat batch, so the three kernels of a step write disjoint rows of
one output; the output of the skipping Triton launch is poisoned first so an unwritten row
cannot pass. The query is a view of fused QKV rows, as the engine's models hand it over.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.kernel_device import assert_matches_reference
from tests.gpu.test_paged_prefill_kernel import _random_inputs

pytestmark = pytest.mark.gpu

MIN_TOKENS = 128
MIN_CONTEXT = 250
CASES = [
    # (chunks as (cached, new) positions, heads, kv_heads, head_dim, block_size, window, dtype)
    (((0, 300), (500, 200), (40, 1), (0, 20), (1000, 129)), 32, 8, 64, 16, None, torch.bfloat16),
    (((2000, 600), (7, 3), (300, 1)), 32, 8, 64, 16, None, torch.bfloat16),
    (((0, 33), (100, 400), (64, 1), (0, 128)), 16, 4, 128, 16, None, torch.float16),
    (((0, 700),), 14, 2, 64, 32, None, torch.bfloat16),
]


def _fused_view(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The same values as a view of [T, (H + 2 Hkv) * D] rows, as the models' fused QKV."""
    tokens, heads, dim = query.shape
    fused = torch.empty(tokens, (heads + 2 * kv_heads) * dim, dtype=query.dtype,
                        device=query.device)  # fmt: skip
    fused.normal_()
    view = fused[:, : heads * dim].view(tokens, heads, dim)
    view.copy_(query)
    return view


def _step(backend, query, k_cache, v_cache, metadata, scale: float) -> torch.Tensor:
    """One layer of a step as the models run it: prepare, then forward with the step's new K/V
    (here the cache's own values at the step's slots, so the write changes nothing)."""
    kv_heads, dim = k_cache.shape[-2:]
    slots = metadata.slot_mapping
    flat_k = k_cache.view(-1, kv_heads, dim)[slots]
    flat_v = v_cache.view(-1, kv_heads, dim)[slots]
    return backend.forward(query, flat_k, flat_v, k_cache, v_cache, metadata, scale=scale)


def _cuda_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("cuDNN's attention runs on a GPU only")


def _long_prefill(gather: bool = True):
    from site_engine.engine.cuda.cudnn_prefill import CudnnLongPrefill

    long_prefill = CudnnLongPrefill.create(MIN_TOKENS, MIN_CONTEXT, gather=gather)
    if long_prefill is None:
        pytest.skip("cudnn-frontend or cuDNN >= 9.7 is missing")
    return long_prefill


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{len(c[0])}seqs-{c[3]}-{c[6]}".replace("torch.", "")
)
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "paged"])
def test_step_with_long_chunks_matches_reference(case, gather: bool) -> None:
    from site_engine.engine.cuda.attention import CudaPagedAttention

    _cuda_or_skip()
    chunks, _heads, kv_heads, dim, _, window, _ = case
    query, k_cache, v_cache, _tables, metadata = _random_inputs(case, 7 + len(chunks), "cuda")
    query = _fused_view(query, kv_heads)
    backend = CudaPagedAttention(_long_prefill(gather))
    assert backend.needs_eager([(n, c + n) for c, n in chunks])
    backend.prepare(metadata)
    out = _step(backend, query, k_cache, v_cache, metadata, dim**-0.5)
    assert backend.long_prefill is not None
    assert backend.long_prefill.num_graphs == 1
    assert_matches_reference(out, query, k_cache, v_cache, metadata, scale=dim**-0.5,
                             window=window)  # fmt: skip


def test_triton_kernel_leaves_long_chunks_to_cudnn() -> None:
    """skip_from: the varlen kernel writes the short chunks and leaves the long ones alone."""
    from site_engine.engine.cuda.paged_prefill import paged_prefill_attention

    _cuda_or_skip()
    case = CASES[0]
    chunks = case[0]
    query, k_cache, v_cache, tables, metadata = _random_inputs(case, 3, "cuda")
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(
        query, k_cache, v_cache, tables, metadata.query_start_loc, metadata.context_lens,
        num_tokens=query.shape[0], scale=0.125, out=out, skip_long=(MIN_TOKENS, MIN_CONTEXT),
    )  # fmt: skip
    starts = metadata.query_start_loc_host
    skipped = [new >= MIN_TOKENS and cached + new >= MIN_CONTEXT for cached, new in chunks]
    assert skipped == [True, True, False, False, True]
    for i, skip in enumerate(skipped):
        rows = out[starts[i] : starts[i + 1]]
        assert bool(torch.isnan(rows).all()) == skip, i


def test_one_graph_serves_steps_of_one_bucket() -> None:
    """Lengths, offsets and tables are tensors: a second step with other lengths in the same
    buckets (and a cache of the same size) reuses the first step's graph, and both match the
    reference."""
    from site_engine.engine.cuda.attention import CudaPagedAttention

    _cuda_or_skip()
    backend = CudaPagedAttention(_long_prefill())
    for chunks in (((0, 300), (20, 1)), ((40, 260), (9, 1))):
        case = (chunks, 32, 8, 64, 16, None, torch.bfloat16)
        query, k_cache, v_cache, _, metadata = _random_inputs(case, sum(chunks[0]), "cuda")
        backend.prepare(metadata)
        out = _step(backend, query, k_cache, v_cache, metadata, 0.125)
        assert_matches_reference(out, query, k_cache, v_cache, metadata, scale=0.125, window=None)
    assert backend.long_prefill is not None
    assert backend.long_prefill.num_graphs == 1


def test_captured_steps_never_take_the_cudnn_path() -> None:
    """A step graph's metadata (for_graph) holds bounds, not chunks: the backend plans nothing
    for it even where its bound looks like a long chunk."""
    import dataclasses

    from site_engine.engine.cuda.attention import CudaPagedAttention

    _cuda_or_skip()
    case = CASES[1]
    query, k_cache, v_cache, _, metadata = _random_inputs(case, 5, "cuda")
    backend = CudaPagedAttention(_long_prefill())
    backend.prepare(dataclasses.replace(metadata, for_graph=True))
    out = _step(backend, query, k_cache, v_cache, metadata, 0.125)
    assert backend.long_prefill is not None
    assert backend.long_prefill.num_graphs == 0
    assert_matches_reference(out, query, k_cache, v_cache, metadata, scale=0.125, window=None)


def test_a_whole_chunk_takes_an_exact_graph() -> None:
    """A step of one chunk whose lengths are multiples of 1,024 (a full chunk of a long prompt
    prefilled alone) runs a graph of its exact dims, decode rows beside it or not; the result
    matches the reference, and a chunk of other lengths goes the ragged way."""
    from site_engine.engine.cuda.attention import CudaPagedAttention
    from site_engine.engine.cuda.cudnn_graphs import ExactKey, RaggedKey

    _cuda_or_skip()
    backend = CudaPagedAttention(_long_prefill())
    long_prefill = backend.long_prefill
    assert long_prefill is not None
    for chunks in (((1024, 1024),), ((1024, 1024), (30, 1)), ((1000, 1048),)):
        case = (chunks, 32, 8, 64, 16, None, torch.bfloat16)
        query, k_cache, v_cache, _, metadata = _random_inputs(case, 9 + len(chunks), "cuda")
        query = _fused_view(query, 8)
        backend.prepare(metadata)
        out = _step(backend, query, k_cache, v_cache, metadata, 0.125)
        assert_matches_reference(out, query, k_cache, v_cache, metadata, scale=0.125, window=None)
    kinds = sorted(type(key).__name__ for key in long_prefill._graphs)
    assert kinds == sorted([ExactKey.__name__, RaggedKey.__name__])
