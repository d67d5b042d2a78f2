"""KV cache sizing arithmetic and layout."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from site_engine.engine.kv_cache import (
    KVCacheSpec,
    PagedKVCache,
    kv_cache_bytes_per_block,
    num_blocks_for_budget,
)

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16)


def test_bytes_per_block() -> None:
    # K and V x 2 layers x 2 heads x 16 dims x 2 bytes x 4 tokens
    assert kv_cache_bytes_per_block(SPEC, 4, torch.float16) == 2 * 2 * 2 * 16 * 2 * 4 == 1024
    assert kv_cache_bytes_per_block(SPEC, 4, torch.float32) == 2048
    assert kv_cache_bytes_per_block(SPEC, 16, torch.bfloat16) == 4096


def test_blocks_for_budget_rounds_down() -> None:
    assert num_blocks_for_budget(10 * 1024 + 1023, SPEC, 4, torch.float16) == 10
    assert num_blocks_for_budget(1023, SPEC, 4, torch.float16) == 0
    assert num_blocks_for_budget(0, SPEC, 4, torch.float16) == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        num_blocks_for_budget(-1, SPEC, 4, torch.float16)
    with pytest.raises(ValueError, match="block_size"):
        kv_cache_bytes_per_block(SPEC, 0, torch.float16)


def test_spec_from_configs() -> None:
    llama = LlamaConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
    )
    assert KVCacheSpec.from_config(llama) == KVCacheSpec(3, 2, 16)
    llama.head_dim = 32  # explicit head_dim wins over hidden_size // heads
    assert KVCacheSpec.from_config(llama) == KVCacheSpec(3, 2, 32)
    gpt2 = GPT2Config(n_embd=64, n_layer=2, n_head=4)
    assert KVCacheSpec.from_config(gpt2) == KVCacheSpec(2, 4, 16)


def test_cache_layout_and_size() -> None:
    cache = PagedKVCache(
        SPEC, num_blocks=5, block_size=4, dtype=torch.float16, device=torch.device("cpu")
    )
    assert cache.key_cache(1).shape == (5, 4, 2, 16)
    assert cache.num_bytes == 5 * kv_cache_bytes_per_block(SPEC, 4, torch.float16)
    cache.value_cache(1)[3, 2] = 1.0
    assert cache.key_cache(1).count_nonzero() == 0
    assert cache.value_cache(0).count_nonzero() == 0
    assert sum(int(layer.count_nonzero()) for layer in cache.layers) == 2 * 16
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(
            SPEC, num_blocks=0, block_size=4, dtype=torch.float16, device=torch.device("cpu")
        )


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_cpu_cache_costs_what_is_written_not_its_budget() -> None:
    """A CPU cache is zeros the kernel fills on first touch: 1 GiB of blocks adds far less
    than that to the process until written, reads as zeros, and keeps what is written, through
    a resize too."""
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64)
    before = _resident_bytes()
    cache = PagedKVCache(spec, num_blocks=8192, block_size=16, dtype=torch.float32,
                         device=torch.device("cpu"))  # fmt: skip
    assert cache.num_bytes == 4 * 2 * 8192 * 16 * 4 * 64 * 4 == 1 << 30
    assert _resident_bytes() - before < 64 << 20
    key = cache.key_cache(3)
    assert key.shape == (8192, 16, 4, 64)
    assert key.is_contiguous()
    assert not key[8000].any()
    key[5].fill_(2.0)
    cache.value_cache(0)[7, 3].fill_(-1.0)
    cache.resize(6)
    assert float(cache.key_cache(3)[5].sum()) == 2.0 * 16 * 4 * 64
    assert float(cache.value_cache(0).sum()) == 0.0  # block 7 was cut
    cache.resize(10)
    assert float(cache.key_cache(3)[5].sum()) == 2.0 * 16 * 4 * 64
    assert not cache.key_cache(3)[6:].any()
