"""Where the Triton kernel tests run: the GPU, or the CPU through Triton's interpreter.

With TRITON_INTERPRET=1 the kernels run on CPU tensors (slowly), which checks their arithmetic
and indexing on a machine without a GPU:
`TRITON_INTERPRET=1 python -m pytest -m gpu tests/gpu/test_paged_*_kernel.py`
(needs the triton package: the dev extra installs it; conftest.py applies upstream's fix for
Triton 3.6's interpreter under numpy 2.4, devtools/triton_interpreter.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from site_engine.engine.attention import AttentionMetadata, TorchReferenceAttention

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-4}


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def skip_bf16_in_interpreter(device: str, dtype: torch.dtype) -> None:
    """Triton's interpreter computes bfloat16 wrongly (numpy has no bfloat16; the decode kernel,
    right on the GPU, fails there too): such cases run only on the GPU."""
    if device == "cpu" and dtype is torch.bfloat16:
        pytest.skip("bfloat16 under Triton's CPU interpreter is not meaningful")


def assert_matches_reference(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
    window: int | None,
) -> None:
    """A kernel's output against the reference attention in float64 over the same cache (the
    reference's write of the step's K/V is a no-op rewrite of what the cache already holds)."""
    kv_heads, dim = k_cache.shape[-2:]
    slots = metadata.slot_mapping
    flat_k = k_cache.view(-1, kv_heads, dim)[slots]
    flat_v = v_cache.view(-1, kv_heads, dim)[slots]
    expected = TorchReferenceAttention().forward(
        query.double(), flat_k.double(), flat_v.double(), k_cache.double(), v_cache.double(),
        metadata, scale=scale, sliding_window=window,
    )  # fmt: skip
    assert not torch.isnan(out).any()
    error = (out.double() - expected).norm() / expected.norm()
    assert error < TOLERANCE[query.dtype], float(error)
