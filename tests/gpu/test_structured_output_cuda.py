"""Constrained decoding on CUDA: grammar masks applied to the logits that the CUDA graphs (decode
and flat step graphs) produce, with async (overlapped) steps and without; free greedy answers
are the same tokens with the constrained requests in the batch as with them free."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedllm_contract.grammar import ConstraintSpec
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import load_model
from tests.support.engine_runs import generate_all

FLAG = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_masks_on_graphed_steps(overlap: bool, cuda_device: str, tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_llama_dir, device=cuda_device, dtype="float32")
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, async_scheduling=overlap)
    spec = ConstraintSpec("json_schema", schema=json.dumps(FLAG))
    prompts = [tuple(range(10 + i, 30 + i)) for i in range(8)]

    def requests(constrained: bool) -> list[EngineRequest]:
        out = []
        for i, prompt in enumerate(prompts):
            masked = constrained and i % 2 == 1
            sampling = SamplingParams(
                max_tokens=160,
                temperature=0.0,
                ignore_eos=not masked,
                constraint=spec if masked else None,
            )
            out.append(EngineRequest(f"r{i}", prompt, sampling))
        return out

    free_engine = PagedEngine(loaded, config)
    assert free_engine.runner.graphs is not None
    free = generate_all(free_engine, requests(False))
    # The engine sizes its KV cache from the free memory: the second one needs the first's back.
    free_engine.close()
    mixed_engine = PagedEngine(loaded, config)
    # Compiled ahead: a grammar compiled off the step loop while the batch runs would keep its
    # rows out of the first steps, and change the batches whose free rows are compared.
    mixed_engine.grammars().guide(spec)
    mixed = generate_all(mixed_engine, requests(True))
    mixed_engine.close()
    tokenizer = loaded.tokenizer
    for i in range(1, 8, 2):
        answer = json.loads(tokenizer.decode(mixed[f"r{i}"]))
        assert set(answer) == {"ok", "n"}
    # Free rows: untouched by the masks. Rows that finish earlier change later steps' batch
    # size, so only the steps before the first constrained row finished are compared.
    shortest = min(len(mixed[f"r{i}"]) for i in range(1, 8, 2))
    for i in range(0, 8, 2):
        assert mixed[f"r{i}"][:shortest] == free[f"r{i}"][:shortest]


@pytest.mark.parametrize("vocab", [49152, 128_256, 1000])
def test_mask_kernel_matches_unpacking_the_words(vocab: int, cuda_device: str) -> None:
    """The one-kernel mask application (site_engine/engine/cuda/grammar_mask.py) forbids exactly
    the tokens whose bit is 0, in the rows named, and leaves every other row and token alone."""
    import torch

    from site_engine.engine.cuda.grammar_mask import mask_logits

    gen = torch.Generator(device=cuda_device).manual_seed(vocab)
    logits = torch.randn(9, vocab, device=cuda_device, generator=gen)
    width = (vocab + 31) // 32
    words = torch.randint(-(2**31), 2**31 - 1, (4, width), device=cuda_device, dtype=torch.int32,
                          generator=gen)  # fmt: skip
    rows = torch.tensor([7, 0, 3, 8], device=cuda_device, dtype=torch.int32)
    expected = logits.clone()
    shifts = torch.arange(32, device=cuda_device, dtype=torch.int32)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).view(4, -1)[:, :vocab]
    for g, row in enumerate(rows.tolist()):
        expected[row] = expected[row].masked_fill(bits[g] == 0, float("-inf"))
    mask_logits(logits, words, rows)
    assert torch.equal(logits, expected)
