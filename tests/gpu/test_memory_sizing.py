"""The CUDA engine's memory: sized from a trial of its real peak, freed at shutdown, and
settings that cannot fit refused with the numbers.

A small Llama with a 128k vocabulary (the sampler's and the logits' memory scale with it) and
131,072 positions (rope scaling), bf16, loaded as a user's model directory is.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.memory_plan import KvCacheTooSmall
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import LLAMA3_ROPE_SCALING, build_random_model
from site_engine.model_loading import LoadedModel, load_model

pytestmark = pytest.mark.gpu
VOCAB = 128256
LIMITS = EngineConfig(max_num_seqs=1024, max_num_batched_tokens=8192)


def _config(positions: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=positions,
        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip


def _model_dir(root: Path, tokenizer_dir: Path, positions: int) -> Path:
    path = root / f"llama-{positions}"
    build_random_model(_config(positions), seed=2).save_pretrained(str(path))
    load_tokenizer(tokenizer_dir).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path) -> LoadedModel:
    path = _model_dir(tmp_path_factory.mktemp("memory"), gpt2_tokenizer_dir, 131072)
    return load_model(path, device="cuda", dtype="bfloat16")


def _serve(engine: PagedEngine, requests: list[EngineRequest]) -> int:
    for request in requests:
        engine.add_request(request)
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens


def _worst_case(count: int, long_prompt: int) -> list[EngineRequest]:
    """Every slot busy, sampling with temperature, top-p and seeds, next to a prompt that fills
    a whole step's token budget."""
    rng = random.Random(0)
    hungry = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    requests = [
        EngineRequest(f"r{i}", tuple(rng.randrange(VOCAB) for _ in range(8)),
                      seeded if i % 3 == 0 else hungry)
        for i in range(count)
    ]  # fmt: skip
    long = tuple(rng.randrange(VOCAB) for _ in range(long_prompt))
    return [EngineRequest("long", long, hungry), *requests]


def test_every_step_fits_the_planned_memory(loaded: LoadedModel) -> None:
    engine = PagedEngine(loaded, LIMITS)
    plan = engine.kv_plan
    assert plan.measurement is not None
    assert plan.full_length_sequences >= 1
    report = engine.startup_report
    assert f"{plan.num_blocks:,} blocks" in report
    assert "CUDA graphs captured" in report
    free, total = torch.cuda.mem_get_info()
    assert free < 0.25 * total, "the KV cache should take what the engine does not need"
    assert _serve(engine, _worst_case(LIMITS.max_num_seqs, 3 * LIMITS.max_num_batched_tokens)) > 0
    engine.close()


def test_engines_one_after_the_other_get_the_same_cache(loaded: LoadedModel) -> None:
    weights = torch.cuda.memory_allocated()
    first = PagedEngine(loaded, LIMITS)
    blocks = first.kv_plan.num_blocks
    _serve(first, _worst_case(64, 100))
    first.close()
    del first
    # What may stay: cuBLAS workspaces of the streams it ran on (tens of MiB each).
    assert torch.cuda.memory_allocated() < weights + (256 << 20), "close() left memory behind"
    second = PagedEngine(loaded, LIMITS)
    assert abs(second.kv_plan.num_blocks - blocks) <= 0.01 * blocks
    _serve(second, _worst_case(64, 100))
    del second  # dropped without close(): the next engine's trial collects it
    gc.collect()
    third = PagedEngine(loaded, LIMITS)
    assert abs(third.kv_plan.num_blocks - blocks) <= 0.01 * blocks
    third.close()


def test_settings_that_cannot_fit_are_refused_with_numbers(
    loaded: LoadedModel, tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    total = torch.cuda.mem_get_info()[1]
    with pytest.raises(KvCacheTooSmall, match=r"does not fit: the device has [\d.]+ GiB"):
        PagedEngine(loaded, EngineConfig(max_num_seqs=16, kv_cache_bytes=total))
    # A model whose one full-length sequence needs more KV than the device has: 2^27 positions
    # of 2 KiB each are 256 GiB (2^26, 128 GiB, fit an H200's 141 GB: this test passed on H100s
    # only).
    huge = load_model(_model_dir(tmp_path, gpt2_tokenizer_dir, 1 << 27), device="cuda",
                      dtype="bfloat16")  # fmt: skip
    with pytest.raises(
        KvCacheTooSmall, match=r"134,217,728 tokens\) the KV cache needs [\d.]+ GiB"
    ):
        PagedEngine(huge, EngineConfig(max_num_seqs=16))
