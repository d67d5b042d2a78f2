"""The whole engine (scheduler + paged runner) against transformers `generate`.

Requests of mixed lengths arrive while others run, some are cancelled (running and queued), the
KV cache is small enough to force recompute preemption and the token budget forces chunked
prefill. Every request that finishes must carry exactly the tokens greedy `generate` produces.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import build_random_model
from site_engine.model_loading import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 40  # 160 token slots for 4 concurrent sequences of up to ~80 tokens: preemption
# No EOS anywhere: generate never stops early; the engine runs with ignore_eos to match.
_NO_SPECIAL = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50257,
        max_position_embeddings=256,
        initializer_range=0.2,
        **_NO_SPECIAL,
    ),
    "gpt2": GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=50257,
        n_positions=256,
        initializer_range=0.2,
        **_NO_SPECIAL,
    ),
}


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_requests(seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    return [
        EngineRequest(
            request_id=f"r{i}",
            prompt_token_ids=tuple(rng.randrange(50257) for _ in range(rng.randint(3, 40))),
            sampling=SamplingParams(
                max_tokens=rng.randint(5, 40), temperature=0.0, ignore_eos=True
            ),
            # Under-predictions: admission plans for short answers, real ones outgrow the cache.
            predicted_tokens=rng.randint(1, 4),
        )
        for i in range(12)
    ]


def reference(model_dir: Path, request: EngineRequest) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return generate_tokens(model, request)


def generate_tokens(model: PreTrainedModel, request: EngineRequest) -> list[int]:
    """Greedy `generate` of `request`'s answer tokens."""
    prompt = torch.tensor([request.prompt_token_ids])
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=request.sampling.max_tokens,
    )
    return list(out[0, prompt.shape[1] :].tolist())


def run_engine(engine: PagedEngine, requests: list[EngineRequest]) -> tuple[dict, dict]:
    """Adds a request every other step; cancels r11 while queued and r1 while running."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, FinishReason] = {}
    for request in (*requests[:4], requests[11]):
        engine.add_request(request)
    pending = list(requests[4:11])
    step = 0
    while engine.has_unfinished() or pending:
        if pending and step % 2 == 0:
            engine.add_request(pending.pop(0))
        if step == 1:
            assert engine.abort("r11", FinishReason.CANCELLED)
            reasons["r11"] = FinishReason.CANCELLED
        if step == 6:
            assert engine.abort("r1", FinishReason.CANCELLED)
            reasons["r1"] = FinishReason.CANCELLED
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                reasons[output.request_id] = output.finish_reason
        step += 1
        assert step < 5000, "the engine stopped making progress"
    assert not engine.abort("r1", FinishReason.CANCELLED)  # already gone: a clean no
    return outputs, reasons


def check_engine_matches_generate(
    arch: str,
    device: str,
    tmp_path: Path,
    tokenizer_dir: Path,
    *,
    async_scheduling: bool,
    cuda_graphs: bool = True,
) -> None:
    """float32 on `device` against float32 `generate` on the CPU: the same tokens, whether steps
    run one at a time or overlapped (async scheduling feeds pending tokens on-device). Shared
    with the GPU tests (tests/gpu/test_engine_matches_generate.py)."""
    model_dir = tmp_path / arch
    build_random_model(CONFIGS[arch], seed=1).save_pretrained(str(model_dir))
    load_tokenizer(tokenizer_dir).save_pretrained(str(model_dir))
    loaded = load_model(model_dir, device=device)
    per_block = kv_cache_bytes_per_block(
        KVCacheSpec.from_config(loaded.model.config), BLOCK_SIZE, torch.float32
    )
    engine = PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=4,
            max_num_batched_tokens=24,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=NUM_BLOCKS * per_block,
            async_scheduling=async_scheduling,
            cuda_graphs=cuda_graphs,
        ),
    )
    assert engine.limits.kv_blocks_total == NUM_BLOCKS
    requests = make_requests(seed=3)
    outputs, reasons = run_engine(engine, requests)

    stats = engine.stats()
    assert stats.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
    for request in requests:
        expected = reference(model_dir, request)
        got = outputs[request.request_id]
        if reasons[request.request_id] is FinishReason.CANCELLED:
            assert got == expected[: len(got)], request.request_id
            assert len(got) < len(expected)
            assert request.request_id != "r11" or got == []
        else:
            assert reasons[request.request_id] is FinishReason.LENGTH
            assert got == expected, request.request_id


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_engine_matches_generate(
    arch: str, overlap: bool, tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    check_engine_matches_generate(
        arch, "cpu", tmp_path, gpt2_tokenizer_dir, async_scheduling=overlap
    )


def test_async_scheduling_samples_seeded_requests_like_sync(
    tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    """Seeded sampling (temperature, top-p) draws the same tokens with overlapped steps."""
    model_dir = tmp_path / "llama"
    build_random_model(CONFIGS["llama"], seed=1).save_pretrained(str(model_dir))
    load_tokenizer(gpt2_tokenizer_dir).save_pretrained(str(model_dir))
    loaded = load_model(model_dir, device="cpu")
    rng = random.Random(5)
    requests = [
        EngineRequest(
            request_id=f"r{i}",
            prompt_token_ids=tuple(rng.randrange(50257) for _ in range(rng.randint(3, 30))),
            sampling=SamplingParams(
                max_tokens=rng.randint(5, 30), temperature=0.9, top_p=0.8, seed=i, ignore_eos=True
            ),
        )
        for i in range(8)
    ]
    results = []
    for overlap in (False, True):
        engine = PagedEngine(
            loaded, EngineConfig(max_num_seqs=4, block_size=BLOCK_SIZE, async_scheduling=overlap)
        )
        results.append(run_engine(engine, [*requests, *make_requests(seed=4)[8:]]))
    (sync_out, sync_reasons), (async_out, async_reasons) = results
    assert sync_reasons == async_reasons
    for request_id, tokens in sync_out.items():
        if sync_reasons[request_id] is FinishReason.CANCELLED:
            # Cancelled at the same step: the overlapped engine has reported one step fewer.
            shorter, longer = sorted((tokens, async_out[request_id]), key=len)
            assert longer[: len(shorter)] == shorter
        else:
            assert async_out[request_id] == tokens, request_id
