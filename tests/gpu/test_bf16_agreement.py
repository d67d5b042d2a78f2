"""Agreement with transformers on the GPU in bf16 (the documented tolerance test).

bf16 results depend on the order of operations, so two correct implementations can pick
different tokens where the top two logits are within rounding of each other, and then diverge.
The test therefore checks what must hold for every step:
1. prefill logits: ||ours - theirs|| / ||theirs|| < 2e-2 against transformers' own bf16 forward;
2. teacher-forced decoding: run transformers (bf16, same GPU) over each sequence the engine
   generated; at every position the engine's greedy token must be transformers' argmax or within
   0.15 of its top logit (a near-tie, where bf16 rounding decides).
The engine runs as served: paged KV cache, Triton decode kernel, CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import build_random_model
from site_engine.model_loading import load_model
from tests.support.engine_runs import generate_all

pytestmark = pytest.mark.gpu
NEAR_TIE = 0.15


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path) -> Path:
    config = LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=50304, max_position_embeddings=2048,
        initializer_range=0.05, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("bf16") / "llama"
    build_random_model(config, seed=5).save_pretrained(str(path))
    load_tokenizer(gpt2_tokenizer_dir).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("long_chunks", ["default", "cudnn"])
def test_engine_agrees_with_transformers_in_bf16(
    model_dir: Path, cuda_device: str, long_chunks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """default: the engine as configured (these prompts are too short for cuDNN's path); cudnn:
    chunks of 32+ tokens from 64 positions on take it (as 4k-token chunks of long prompts do
    when served), in 128-token steps with decode rows in them."""
    from site_engine.engine.cuda.cudnn_prefill import CudnnLongPrefill

    config = EngineConfig(max_num_seqs=32, kv_cache_bytes=1 << 30)
    if long_chunks == "cudnn":
        if CudnnLongPrefill.create() is None:
            pytest.skip("cudnn-frontend or cuDNN >= 9.7 is missing")
        create = CudnnLongPrefill.create
        monkeypatch.setattr(CudnnLongPrefill, "create",
                            lambda *_, **__: create(min_tokens=32, min_context=64))  # fmt: skip
        config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=128,
                              kv_cache_bytes=1 << 30)  # fmt: skip
    loaded = load_model(model_dir, device=cuda_device, dtype="bfloat16")
    engine = PagedEngine(loaded, config)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 300, (24,), generator=generator).tolist()
    requests = [
        EngineRequest(
            f"r{i}",
            tuple(torch.randint(0, 50257, (n,), generator=generator).tolist()),
            SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        )
        for i, n in enumerate(lengths)
    ]
    outputs = generate_all(engine, requests)

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda()
    ties = 0
    for request in requests:
        generated = outputs[request.request_id]
        assert len(generated) == 48
        ids = torch.tensor([list(request.prompt_token_ids) + generated], device="cuda")
        with torch.inference_mode():
            logits = reference(input_ids=ids).logits[0].float()
        steps = logits[len(request.prompt_token_ids) - 1 : -1]
        chosen = steps.gather(1, torch.tensor(generated, device="cuda")[:, None])[:, 0]
        gap = steps.max(dim=1).values - chosen
        assert float(gap.max()) <= NEAR_TIE, (request.request_id, float(gap.max()))
        ties += int((gap > 0).sum())
    # Near-ties happen, but rarely: most steps pick transformers' own argmax.
    assert ties <= 0.05 * 48 * len(requests), ties
    if long_chunks == "cudnn":
        long_prefill = engine._runner.attention.long_prefill  # type: ignore[attr-defined]
        assert long_prefill.num_graphs > 0  # the path ran


def test_prefill_logits_match(model_dir: Path, cuda_device: str) -> None:
    loaded = load_model(model_dir, device=cuda_device, dtype="bfloat16")
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=4, kv_cache_bytes=1 << 28))
    prompt = list(range(1000, 1200))
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        theirs = loaded.model(input_ids=ids).logits[0, -1].float()
    runner = engine.runner
    from site_engine.engine.core.types import ScheduledChunk

    chunk = ScheduledChunk("p", tuple(prompt), 0, tuple(range(13)), True,
                           SamplingParams(max_tokens=1, temperature=0.0), 0)  # fmt: skip
    with torch.inference_mode():
        layout = runner.layout_chunks([chunk])
        hidden = runner.forward(layout)
        ours = runner.flat_model.compute_logits(hidden[-1:])[0]
    error = (ours - theirs).norm() / theirs.norm()
    assert error < 2e-2, float(error)
    assert runner.execute_chunks(()).sampled_token_ids == {}
