"""The model runner against transformers itself, on tiny random models loaded from disk.

A small driver plays the scheduler: it admits sequences at given steps, splits prompts into
chunks, hands out blocks from a shuffled free list (so tables are non-contiguous and freed blocks
get reused), and mixes prefill and decode chunks in one flat batch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.model_runner import ModelRunner
from site_engine.engine.models import UnsupportedModelError

BLOCK_SIZE = 4
NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
# Larger than the default init so that outputs depend on context, not just the last token.
_COMMON: dict[str, Any] = {
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
_LLAMA_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    **_COMMON,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**_LLAMA_DIMS, tie_word_embeddings=False, rope_parameters=_LLAMA3_ROPE),
    # Layer 1 slides over 6 positions, layer 0 sees everything: per-layer windows.
    "qwen2": Qwen2Config(
        **_LLAMA_DIMS,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
    "mistral": MistralConfig(**_LLAMA_DIMS, sliding_window=8),
    "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=256, **_COMMON),
}


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    # These matrices are tiny: intra-op threads only add overhead on a shared 2-core machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def save_and_load(config: PretrainedConfig, directory: Path) -> PreTrainedModel:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return save_and_load(CONFIGS[request.param], tmp_path_factory.mktemp(request.param))


def make_runner(model: PreTrainedModel, num_blocks: int = NUM_BLOCKS) -> ModelRunner:
    return ModelRunner(
        model,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


@dataclass
class Plan:
    """One request as the driver schedules it."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    prefill_chunks: tuple[int, ...] = ()  # prompt split; empty = the whole prompt at once
    sampling: SamplingParams = GREEDY
    preempt_after: int | None = None  # drop the cache after this many tokens, then recompute
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_generated: int = 0
    prefill_len: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.prefill_len = len(self.prompt)
        assert sum(self.prefill_chunks) in (0, len(self.prompt))

    @property
    def done(self) -> bool:
        return self.num_generated == self.max_new_tokens

    def next_chunk_len(self) -> int:
        if self.num_computed >= self.prefill_len:
            return 1  # decode: the last sampled token
        chunks = self.prefill_chunks or (self.prefill_len,)
        done_so_far, index = 0, 0
        while done_so_far < self.num_computed:
            done_so_far += chunks[index]
            index += 1
        return chunks[index]


def drive(runner: ModelRunner, plans: list[Plan], seed: int = 0) -> dict[str, list[int]]:
    """Step the runner until every plan has generated its tokens; returns generated tokens."""
    free_blocks = list(range(runner.num_blocks))
    random.Random(seed).shuffle(free_blocks)
    finished: set[str] = set()
    step = 0
    while not all(plan.done for plan in plans):
        chunks = []
        for plan in plans:
            if plan.done or plan.arrival_step > step:
                continue
            start, length = plan.num_computed, plan.next_chunk_len()
            end = start + length
            while len(plan.blocks) * BLOCK_SIZE < end:
                plan.blocks.append(free_blocks.pop())
            chunks.append(
                ScheduledChunk(
                    request_id=plan.request_id,
                    token_ids=tuple(plan.tokens[start:end]),
                    start_position=start,
                    block_table=tuple(plan.blocks),
                    sample=end == len(plan.tokens),
                    sampling=plan.sampling,
                    num_generated=plan.num_generated,
                )
            )
        result = runner.execute_chunks(chunks, frozenset(finished))
        finished = set()
        for chunk in chunks:
            plan = next(p for p in plans if p.request_id == chunk.request_id)
            plan.num_computed = chunk.start_position + chunk.num_tokens
            assert (chunk.request_id in result.sampled_token_ids) == chunk.sample
            if chunk.sample:
                plan.tokens.append(result.sampled_token_ids[chunk.request_id])
                plan.num_generated += 1
            if plan.done or plan.num_generated == plan.preempt_after:
                finished.add(plan.request_id)
                free_blocks.extend(plan.blocks)  # reused by later arrivals, with stale contents
            if not plan.done and plan.num_generated == plan.preempt_after:
                # Recompute preemption: the next prefill covers prompt + generated tokens.
                plan.blocks, plan.num_computed, plan.preempt_after = [], 0, None
                plan.prefill_len, plan.prefill_chunks = len(plan.tokens), ()
        step += 1
    return {plan.request_id: plan.tokens[len(plan.prompt) :] for plan in plans}


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
    )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def test_greedy_mixed_batches_match_generate(hf_model: PreTrainedModel) -> None:
    plans = [
        Plan("a", random_prompt(13, 1), max_new_tokens=8),
        Plan("b", random_prompt(3, 2), max_new_tokens=6),
        # Split prompt: first chunk is not sampled; it arrives while a and b decode.
        Plan("c", random_prompt(11, 3), max_new_tokens=7, arrival_step=1, prefill_chunks=(6, 5)),
        Plan("d", random_prompt(9, 4), max_new_tokens=5, arrival_step=3),
        # Arrives after b finished, so it gets b's freed blocks.
        Plan("e", random_prompt(17, 5), max_new_tokens=6, arrival_step=7, prefill_chunks=(7, 10)),
    ]
    expected = {p.request_id: hf_greedy(hf_model, p.prompt, p.max_new_tokens) for p in plans}
    assert drive(make_runner(hf_model), plans) == expected


def test_prefill_logits_match_forward(hf_model: PreTrainedModel) -> None:
    runner = make_runner(hf_model)
    prompts = [random_prompt(10, 7), random_prompt(5, 8)]
    chunks = tuple(
        ScheduledChunk(
            request_id=str(i),
            token_ids=tuple(prompt),
            start_position=0,
            block_table=tuple(range(10 * i + 9, 10 * i, -1)),  # descending, non-contiguous
            sample=True,
            sampling=GREEDY,
            num_generated=0,
        )
        for i, prompt in enumerate(prompts)
    )
    with torch.inference_mode():
        layout = runner.layout_chunks(chunks)
        logits = runner.flat_model.compute_logits(runner.forward(layout))
        start = 0
        for prompt in prompts:
            expected = hf_model(torch.tensor([prompt])).logits[0].float()
            torch.testing.assert_close(logits[start : start + len(prompt)], expected)
            start += len(prompt)
    assert logits.dtype == torch.float32


def test_seeded_request_same_alone_and_batched(hf_model: PreTrainedModel) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)

    def seeded_plan() -> Plan:
        return Plan("s", random_prompt(6, 9), max_new_tokens=6, sampling=seeded)

    alone = drive(make_runner(hf_model), [seeded_plan()])
    others = [
        Plan("x", random_prompt(12, 10), 8, sampling=SamplingParams(max_tokens=16)),
        Plan("y", random_prompt(4, 11), 5, sampling=SamplingParams(max_tokens=16, seed=99)),
        Plan("z", random_prompt(7, 12), 4, arrival_step=2),
    ]
    batched = drive(make_runner(hf_model), [*others, seeded_plan()], seed=3)
    assert batched["s"] == alone["s"]


def test_recompute_preemption_keeps_greedy_and_seeded_streams(hf_model: PreTrainedModel) -> None:
    prompt = random_prompt(9, 13)
    expected = hf_greedy(hf_model, prompt, 7)
    greedy = drive(make_runner(hf_model), [Plan("g", prompt, 7, preempt_after=3)])
    assert greedy["g"] == expected
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=77)
    plain = drive(make_runner(hf_model), [Plan("s", prompt, 7, sampling=seeded)])
    preempted = [Plan("s", prompt, 7, sampling=seeded, preempt_after=4), Plan("o", prompt, 5)]
    assert drive(make_runner(hf_model), preempted, seed=5)["s"] == plain["s"]


def test_runner_properties_and_empty_step(tmp_path: Path) -> None:
    model = save_and_load(CONFIGS["llama"], tmp_path)
    model.config.eos_token_id = 2
    model.generation_config.eos_token_id = [5, 7]
    runner = make_runner(model)
    assert runner.max_model_len == 256
    assert runner.vocab_size == 512
    assert runner.eos_token_ids == frozenset({2, 5, 7})
    assert runner.execute_chunks(()).sampled_token_ids == {}


def test_finished_requests_drop_sampler_state(tmp_path: Path) -> None:
    runner = make_runner(save_and_load(CONFIGS["gpt2"], tmp_path))
    seeded = SamplingParams(max_tokens=4, seed=5)
    chunk = ScheduledChunk("r", (1, 2, 3), 0, (3,), True, seeded, 0)
    runner.execute_chunks((chunk,))
    assert runner.sampler.num_tracked_requests == 1
    runner.execute_chunks((), frozenset({"r"}))
    assert runner.sampler.num_tracked_requests == 0


def test_unsupported_model_type_lists_supported(tmp_path: Path) -> None:
    config = OPTConfig(
        hidden_size=16,
        ffn_dim=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        word_embed_proj_dim=16,
    )
    with pytest.raises(UnsupportedModelError, match=r"'opt'.*gpt2, llama, mistral, qwen2"):
        make_runner(save_and_load(config, tmp_path))


def test_bad_chunks_are_rejected(tmp_path: Path) -> None:
    runner = make_runner(save_and_load(CONFIGS["gpt2"], tmp_path), num_blocks=8)
    too_few_blocks = ScheduledChunk("r", (1,) * 9, 0, (0, 1), True, GREEDY, 0)
    with pytest.raises(ValueError, match="cannot hold 9 positions"):
        runner.execute_chunks((too_few_blocks,))
    bad_block = ScheduledChunk("r", (1, 2), 0, (8,), True, GREEDY, 0)
    with pytest.raises(ValueError, match="out of range"):
        runner.execute_chunks((bad_block,))
    past_end = ScheduledChunk("r", (1,), 256, tuple(range(8)), True, GREEDY, 3)
    with pytest.raises(ValueError, match="max length 256"):
        runner.execute_chunks((past_end,))


def test_model_must_already_have_the_cache_dtype(tmp_path: Path) -> None:
    model = save_and_load(CONFIGS["gpt2"], tmp_path)
    with pytest.raises(ValueError, match=r"as torch\.float32 but"):
        ModelRunner(
            model, num_blocks=4, block_size=4, device=torch.device("cpu"), dtype=torch.bfloat16
        )
