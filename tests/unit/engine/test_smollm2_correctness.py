"""The engine on real weights: SmolLM2-135M-Instruct (from its GGUF file, through the sites'
loading path) against transformers `generate`, float32 on the CPU.

Chat prompts of mixed length arrive while others decode; a small token budget splits the long
prompts into prefill chunks that share steps with decode rows. Greedy answers must be the same
tokens, real EOS included (no ignore_eos: the model decides where its answers end).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel
from tests.unit.engine.smollm2 import chat_ids, loaded

pytestmark = pytest.mark.slow
__all__ = ["loaded"]  # the module-scoped fixture, shared with the other SmolLM2 tests

PROMPTS = (
    "Give three tips for staying healthy.",
    "What is the capital of France?",
    "Summarize the following text in one sentence.\n\n"
    + (
        "The committee met on Tuesday to review the budget for the coming year. After a long "
        "discussion about rising costs of energy and materials, the members agreed to postpone "
        "two construction projects, to raise the maintenance budget by five percent, and to "
        "ask every department for a plan that saves at least three percent of its spending. "
    )
    * 3,
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Hi",
)
MAX_TOKENS = 24


def test_gguf_model_answers_like_generate(loaded: LoadedModel, smollm2_dir: Path) -> None:
    assert loaded.model.config.model_type == "llama"
    assert loaded.eos_token_ids == {2}  # <|im_end|>: the chat turn's end
    requests = [
        EngineRequest(f"r{i}", chat_ids(loaded, p), SamplingParams(MAX_TOKENS, temperature=0.0))
        for i, p in enumerate(PROMPTS)
    ]
    assert max(len(r.prompt_token_ids) for r in requests) > 150  # long enough to be chunked
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=48))
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, FinishReason] = {}
    pending = list(requests)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:  # arrivals while others decode
            engine.add_request(pending.pop(0))
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                reasons[output.request_id] = output.finish_reason
        step += 1
        assert step < 2000, "the engine stopped making progress"

    reference = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    stopped = 0
    for request in requests:
        prompt = torch.tensor([request.prompt_token_ids])
        out = reference.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
        )
        expected = out[0, prompt.shape[1] :].tolist()
        got = outputs[request.request_id]
        assert got == expected, (request.request_id, got, expected)
        if reasons[request.request_id] is FinishReason.STOP:
            stopped += 1
            assert got[-1] in loaded.eos_token_ids
    assert stopped >= 1, "some answer should end at the model's own EOS within the budget"
