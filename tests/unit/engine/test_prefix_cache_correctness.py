"""Prefix caching through the whole engine: greedy output token-identical with caching off, with
it on, with a host tier, and to transformers `generate` (CPU float32, small random models saved
and loaded through the real loading path).

Prompts share a prefix of every length from 0 to past four blocks, block-aligned ones included
(a prompt that is exactly a cached chain still computes its last token), arrive one per step
while others run, meet a cache so small that cached blocks are evicted and running ones
preempted, and some are cancelled. With the host tier, blocks evicted from the device come back
from host memory. The counters must show that the cache did the work: fewer prompt tokens
computed, hits from each tier, and each request's cached prompt tokens in its outputs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest, EngineStats
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import build_random_model
from site_engine.model_loading import LoadedModel, load_model
from tests.unit.engine.test_engine_correctness import CONFIGS, generate_tokens

BLOCK_SIZE = 4
VOCAB = 50257


def shared_prefix_requests(seed: int) -> list[EngineRequest]:
    """Eight requests behind 14-21 tokens of a common prefix A, eight with prompts of their own
    (enough to push A's blocks out of a small cache), then 22 behind the first 21, 20, ..., 0
    tokens of A. Each prompt ends with a tail of 0-3 tokens of its own (none on some
    block-aligned prefixes, whose prompts are then exactly a chain of full blocks)."""
    rng = random.Random(seed)
    commons = [[rng.randrange(VOCAB) for _ in range(22)] for _ in range(9)]
    shapes = [(0, 14 + i) for i in range(8)] + [(1 + i, 14 + i) for i in range(8)]
    shapes += [(0, shared) for shared in reversed(range(22))]
    requests = []
    for i, (common, shared) in enumerate(shapes):
        tail_len = rng.randint(0, 3) if shared % BLOCK_SIZE or i % 2 else 0
        prompt = commons[common][:shared]
        prompt += [rng.randrange(VOCAB) for _ in range(max(tail_len, 1 - shared))]
        requests.append(
            EngineRequest(
                request_id=f"r{i}",
                prompt_token_ids=tuple(prompt),
                sampling=SamplingParams(
                    max_tokens=rng.randint(4, 20), temperature=0.0, ignore_eos=True
                ),
                predicted_tokens=rng.randint(1, 4),
            )
        )
    return requests


def run_staggered(
    engine: PagedEngine, requests: list[EngineRequest], cancel: dict[int, str]
) -> tuple[dict[str, list[int]], dict[str, FinishReason], dict[str, int]]:
    """Adds one request per step (two at first); cancels cancel[step] at that step."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, FinishReason] = {}
    cached: dict[str, int] = {}
    pending = list(requests)
    step = 0
    while engine.has_unfinished() or pending:
        for _ in range(2 if step == 0 else 1):
            if pending:
                engine.add_request(pending.pop(0))
        if step in cancel and engine.abort(cancel[step], FinishReason.CANCELLED):
            reasons[cancel[step]] = FinishReason.CANCELLED
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
            cached[output.request_id] = output.cached_prompt_tokens
            if output.finish_reason is not None:
                reasons[output.request_id] = output.finish_reason
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return outputs, reasons, cached


def build(tmp_path: Path, tokenizer_dir: Path, arch: str, device: str = "cpu") -> LoadedModel:
    model_dir = tmp_path / arch
    build_random_model(CONFIGS[arch], seed=2).save_pretrained(str(model_dir))
    load_tokenizer(tokenizer_dir).save_pretrained(str(model_dir))
    return load_model(model_dir, device=device)


def engine_for(
    loaded: LoadedModel, num_blocks: int, host_blocks: int = 0, **options: Any
) -> PagedEngine:
    per_block = kv_cache_bytes_per_block(
        KVCacheSpec.from_config(loaded.model.config), BLOCK_SIZE, torch.float32
    )
    config = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=10,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=num_blocks * per_block,
        host_kv_cache_bytes=host_blocks * per_block,
        model_name="tiny",
        **options,
    )
    return PagedEngine(loaded, config)


def check_against(
    expected: dict[str, list[int]],
    got: dict[str, list[int]],
    reasons: dict[str, FinishReason],
) -> None:
    for request_id, tokens in got.items():
        if reasons[request_id] is FinishReason.CANCELLED:
            assert tokens == expected[request_id][: len(tokens)], request_id
        else:
            assert reasons[request_id] is FinishReason.LENGTH, request_id
            assert tokens == expected[request_id], request_id


def check_caching_on_off_host_tier_and_generate_agree(
    arch: str,
    device: str,
    tmp_path: Path,
    tokenizer_dir: Path,
    *,
    async_scheduling: bool,
    cuda_graphs: bool = True,
) -> None:
    """float32 on `device` against float32 `generate` on the CPU. Shared with the GPU tests
    (tests/gpu/test_prefix_cache_on_cuda.py)."""
    loaded = build(tmp_path, tokenizer_dir, arch, device)
    requests = shared_prefix_requests(seed=7)
    cancel = {9: "r6", 20: "r13", 40: "r30"}
    runs: dict[str, tuple[dict[str, list[int]], dict[str, FinishReason], dict[str, int]]] = {}
    stats: dict[str, EngineStats] = {}
    # 24 blocks of 4: room for the running batch and a few cached chains, so cached blocks are
    # evicted (and copied to the host tier) and long sequences preempted.
    arms: dict[str, dict[str, Any]] = {
        "off": {"prefix_caching": False},
        "device": {},
        "host": {"host_blocks": 200},
    }
    for name, options in arms.items():
        engine = engine_for(
            loaded, 24, async_scheduling=async_scheduling, cuda_graphs=cuda_graphs, **options
        )
        runs[name] = run_staggered(engine, requests, cancel)
        stats[name] = engine.stats()
        assert (stats[name].kv_blocks_used, stats[name].num_running) == (0, 0)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / arch), dtype=torch.float32).eval()
    expected = {r.request_id: generate_tokens(model, r) for r in requests}
    for arm, (outputs, reasons, _) in runs.items():
        assert reasons.keys() == expected.keys(), arm
        check_against(expected, outputs, reasons)
    off, on, host = stats["off"], stats["device"], stats["host"]
    assert off.prefix_cache_queries == 0
    assert on.prefix_cache_hits > 0
    assert on.prompt_tokens_computed < off.prompt_tokens_computed
    assert host.prefix_cache_host_hits > 0
    assert host.host_kv_bytes_onloaded > 0
    assert host.prompt_tokens_computed < on.prompt_tokens_computed
    assert on.num_preemptions + host.num_preemptions > 0
    # Usage: what each request's first admission found cached, never its last prompt token.
    _, _, cached = runs["device"]
    for request in requests:
        assert 0 <= cached.get(request.request_id, 0) < len(request.prompt_token_ids)
        assert cached.get(request.request_id, 0) % BLOCK_SIZE == 0
    assert sum(cached.values()) > 0
    assert sum(runs["off"][2].values()) == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_caching_on_off_host_tier_and_generate_agree(
    arch: str, overlap: bool, tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    torch.set_num_threads(1)
    check_caching_on_off_host_tier_and_generate_agree(
        arch, "cpu", tmp_path, gpt2_tokenizer_dir, async_scheduling=overlap
    )


def test_block_aligned_whole_prompt_still_computes_its_last_token(
    tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    """A prompt that is exactly a cached chain (two full blocks) reuses the first block only:
    the second holds its last token, whose logits the first answer token needs."""
    loaded = build(tmp_path, gpt2_tokenizer_dir, "llama")
    engine = engine_for(loaded, 16)
    prompt = tuple(range(1000, 1000 + 2 * BLOCK_SIZE))
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    answers, cached = [], []
    for name in ("first", "again"):
        engine.add_request(EngineRequest(name, prompt, sampling))
        tokens: list[int] = []
        while engine.has_unfinished():
            for output in engine.step():
                tokens.extend(output.new_token_ids)
                cached.append(output.cached_prompt_tokens)
        answers.append(tokens)
    assert answers[0] == answers[1]
    assert cached[0] == 0
    assert cached[-1] == BLOCK_SIZE
    stats = engine.stats()
    assert stats.prefix_cache_hits == BLOCK_SIZE
    assert stats.prompt_tokens_computed == 2 * BLOCK_SIZE + BLOCK_SIZE


def test_salts_keep_tenants_apart(tmp_path: Path, gpt2_tokenizer_dir: Path) -> None:
    loaded = build(tmp_path, gpt2_tokenizer_dir, "llama")
    engine = engine_for(loaded, 32)
    prompt = tuple(range(2000, 2000 + 3 * BLOCK_SIZE + 1))
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for name, salt in (("a", "key-1"), ("b", "key-2"), ("c", "key-1")):
        engine.add_request(EngineRequest(name, prompt, sampling, cache_salt=salt))
        while engine.has_unfinished():
            engine.step()
    # Only "c" (the salt of "a") found the three full blocks.
    assert engine.stats().prefix_cache_hits == 3 * BLOCK_SIZE
