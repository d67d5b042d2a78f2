"""The HBM roofline of the GPU engine benchmark: what a decode step must read, and how fast.

This module owns the memory-bound side of the decode comparison: the measured device-to-device
copy rate (the best rate measured for HBM traffic), the bytes a decode step reads (every weight
once, plus the KV blocks of the running sequences), and ROOFLINE_METHOD, the text that the
results file carries to say how roofline_step_ms is computed from them. The arithmetic itself
(kv_bytes_per_token, roofline_ms) lives in bench.engine.metrics.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.engine.harness import free_device_memory
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.model_loading import LoadedModel

ROOFLINE_METHOD = (
    "roofline_step_ms = bytes read by one decode step / measured copy rate. Bytes read = every "
    "parameter once (the tied embedding counted once: the lm_head matmul reads it) + the KV of "
    "every running sequence (b * context_len * 2 (K and V) * layers * kv_heads * head_dim * "
    "dtype bytes, context_len = the tokens each sequence attends to at that step, averaged over "
    "the timed steps). Copy rate = (bytes read + bytes written) / time of a device-to-device "
    "copy of copy_bandwidth.bytes (median of 10 after 3 warm-ups): a decode step is almost all "
    "reads, and HBM traffic is what bounds it, so the time of its traffic at the best rate "
    "measured for traffic is its lower bound. Activations, KV writes and logits are ignored "
    "(they are small at these sizes), so the ratio decode_step_ms / roofline_step_ms >= 1 "
    "measures how far a whole engine step (scheduling, input building, kernels, sampling) is "
    "from the memory bound."
)


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes of every parameter once (parameters() yields a tied tensor once)."""
    return sum(p.numel() * p.element_size() for p in loaded.model.parameters())


def kv_block_bytes(loaded: LoadedModel, block_size: int) -> int:
    spec = KVCacheSpec.from_config(loaded.model.config)
    return kv_cache_bytes_per_block(spec, block_size, loaded.dtype)


def measure_copy_bandwidth(
    device: torch.device, nbytes: int, repeats: int = 10, warmup: int = 3
) -> dict[str, Any]:
    """Median time of dst.copy_(src) for `nbytes` bytes; the rate counts read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    times_ms: list[float] = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            event = getattr(torch.cuda, "Event")  # noqa: B009 (untyped in some torch releases)
            start, end = event(enable_timing=True), event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            elapsed = float(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            dst.copy_(src)
            elapsed = (time.perf_counter() - began) * 1000.0
        if i >= warmup:
            times_ms.append(elapsed)
    del src, dst
    free_device_memory(device)
    median_ms = statistics.median(times_ms)
    rate = 2 * nbytes / (median_ms / 1000.0)
    return {
        "bytes": nbytes,
        "median_ms": median_ms,
        "min_ms": min(times_ms),
        "read_write_bytes_per_s": rate,
        "read_write_gb_per_s": rate / 1e9,
        "timing": "CUDA events" if device.type == "cuda" else "perf_counter",
        "note": "rate = (bytes read + bytes written) / median time",
    }
