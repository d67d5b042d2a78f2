"""Idle memory first on a real engine (PagedEngine.lend_kv / return_kv): the lent top of the KV
cache is released (the cache's tensors shrink) and re-acquired with the kept blocks intact, the
scheduler never hands out a lent block, the lending never takes a block a running sequence
holds, and sequences running across the lend and the return produce the tokens they would
without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.kv_cache import KVCacheSpec, PagedKVCache, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import build_random_model
from site_engine.model_loading import load_model

BLOCK = 4
NUM_BLOCKS = 64
MAX_LEN = 128  # the lender keeps 32 blocks: one full-length sequence
CONFIG = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=50257, max_position_embeddings=MAX_LEN,
    initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16)
PER_BLOCK = kv_cache_bytes_per_block(SPEC, BLOCK, torch.float32)


def test_the_cache_shrinks_and_grows_back_keeping_the_lower_blocks() -> None:
    cache = PagedKVCache(SPEC, num_blocks=10, block_size=BLOCK, dtype=torch.float32,
                         device=torch.device("cpu"))  # fmt: skip
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape))
    kept = [layer[:, :6].clone() for layer in cache.layers]
    cache.resize(6)
    assert [tuple(layer.shape) for layer in cache.layers] == [(2, 6, BLOCK, 2, 16)] * 2
    assert cache.num_bytes == 6 * PER_BLOCK
    assert cache.num_blocks == 6
    cache.resize(10)
    assert cache.num_bytes == 10 * PER_BLOCK
    for layer, before in zip(cache.layers, kept, strict=True):
        assert torch.equal(layer[:, :6], before)
        assert layer[:, 6:].count_nonzero() == 0
    assert cache.key_cache(1).shape == (10, BLOCK, 2, 16)
    with pytest.raises(ValueError, match="num_blocks"):
        cache.resize(0)
    assert cache.num_blocks == 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("lending") / "llama"
    build_random_model(CONFIG, seed=1).save_pretrained(str(out))
    load_tokenizer(gpt2_tokenizer_dir).save_pretrained(str(out))
    return out


def request(rid: str, prompt_len: int, max_tokens: int) -> EngineRequest:
    prompt = tuple((7 * i + len(rid) * 131) % 50257 for i in range(prompt_len))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)


def engine_for(model_dir: Path, async_scheduling: bool) -> PagedEngine:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=BLOCK,
                          kv_cache_bytes=NUM_BLOCKS * PER_BLOCK, prefix_caching=False,
                          async_scheduling=async_scheduling)  # fmt: skip
    return PagedEngine(load_model(model_dir, device="cpu"), config)


def held(engine: PagedEngine) -> set[int]:
    manager = engine._scheduler.block_manager
    return {b for rid in manager.request_ids() for b in manager.block_table(rid)}


def run(engine: PagedEngine, lend_at: int = -1, return_at: int = -1) -> dict[str, list[int]]:
    """A warm-up request that leaves its blocks at the end of the free queue, then two that run
    across a lending made at step `lend_at` and returned at `return_at` (-1: never)."""
    engine.add_request(request("warm", 100, 4))  # blocks 0-26, free again (handed out last)
    tokens: dict[str, list[int]] = {"warm": [], "a": [], "b": []}
    step = 0
    while engine.has_unfinished() or step < 2:
        if step == 1:
            engine.add_request(request("a", 40, 40))
            engine.add_request(request("b", 20, 40))
        if step == lend_at:
            lend_around_running_sequences(engine)
        if step == return_at:
            assert engine.return_kv()
            assert engine.runner.kv_cache.num_bytes == NUM_BLOCKS * PER_BLOCK
            assert engine.limits.kv_blocks_total == NUM_BLOCKS
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
        if lend_at <= step < return_at:
            lent_from = NUM_BLOCKS - engine._scheduler.block_manager.num_lent_blocks
            assert max(held(engine)) < lent_from, "a lent block was handed out"
        step += 1
        assert step < 500
    return tokens


def lend_around_running_sequences(engine: PagedEngine) -> None:
    """a and b hold blocks above the warm-up's: the lendable tail stops at their highest."""
    highest = max(held(engine))
    room = engine.kv_room()
    assert room == (NUM_BLOCKS - 1 - highest) * PER_BLOCK
    assert 0 < room < (NUM_BLOCKS - MAX_LEN // BLOCK) * PER_BLOCK, "test set-up: a held top"
    # One block more than the free top would take a held block (or none below it): refused.
    assert engine.lend_kv(room + PER_BLOCK) == 0
    assert engine.runner.kv_cache.num_bytes == NUM_BLOCKS * PER_BLOCK
    assert engine.lend_kv(room) == room
    kept = NUM_BLOCKS - room // PER_BLOCK
    assert [layer.shape[1] for layer in engine.runner.kv_cache.layers] == [kept] * 2
    assert engine.runner.kv_cache.num_bytes == kept * PER_BLOCK
    assert engine.kv_plan.num_blocks == engine.limits.kv_blocks_total == kept
    assert max(held(engine)) < kept
    assert engine.kv_room() == 0
    with pytest.raises(ValueError, match="already lends"):
        engine.lend_kv(PER_BLOCK)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_lending_releases_the_free_top_and_sequences_run_on_unchanged(
    model_dir: Path, overlap: bool
) -> None:
    alone = run(engine_for(model_dir, overlap))
    engine = engine_for(model_dir, overlap)
    lent = run(engine, lend_at=8, return_at=30)
    assert lent == alone
    assert all(len(tokens) in (4, 40) for tokens in lent.values())
    assert not engine.return_kv()  # nothing lent any more
    engine._scheduler.check_invariants()
    assert engine.kv_room() > 0


def test_a_lending_is_refused_with_no_change_below_the_blocks_kept(model_dir: Path) -> None:
    engine = engine_for(model_dir, False)
    keep = MAX_LEN // BLOCK
    assert engine.kv_room() == (NUM_BLOCKS - keep) * PER_BLOCK
    assert engine.lend_kv((NUM_BLOCKS - keep + 1) * PER_BLOCK) == 0
    assert engine.runner.kv_cache.num_bytes == NUM_BLOCKS * PER_BLOCK
    with pytest.raises(ValueError, match="byte"):
        engine.lend_kv(0)
    # A lending covers whole blocks: a byte over one block lends two.
    assert engine.lend_kv(PER_BLOCK + 1) == 2 * PER_BLOCK
    with pytest.raises(RuntimeError, match="lends nothing"):
        engine.restart_scheduler(prefix_caching=True, host_tier=False)
    assert engine.return_kv()
    engine.restart_scheduler(prefix_caching=True, host_tier=False)
    assert engine.kv_plan.num_blocks == NUM_BLOCKS
