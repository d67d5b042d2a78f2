"""Long-context models (Llama-3.1 rope scaling, 32k-128k positions) load and serve exactly.

The model directory's config.json is written as Llama-3.1's is (`rope_scaling` of type "llama3"
next to `rope_theta`), loaded through site_engine.model_loading like a user's checkpoint, and
served by the engine with chunked prefill over positions far past the rope scaling's original
context; greedy tokens must equal transformers' `generate` on the same weights (float32, CPU).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import make_long_context_dir
from site_engine.model_loading import load_model
from tests.support.engine_runs import generate_all

# Small numbers with the real structure: the scaling starts past 256 positions, the prompt
# reaches 1,500, the model declares 65,536.
ORIGINAL, POSITIONS, PROMPT = 256, 65536, 1500


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory: pytest.TempPathFactory, gpt2_tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("models") / "long-llama"
    return make_long_context_dir(
        out, gpt2_tokenizer_dir, max_positions=POSITIONS, original_positions=ORIGINAL, seed=4
    )


def _greedy(model: torch.nn.Module, prompt: list[int], tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_config_is_loaded_with_its_rope_scaling(long_dir: Path) -> None:
    assert "rope_scaling" in json.loads((long_dir / "config.json").read_text())
    loaded = load_model(long_dir, device="cpu")
    assert loaded.max_model_len == POSITIONS
    rope = getattr(loaded.model.config, "rope_parameters", None) or loaded.model.config.rope_scaling
    assert rope["rope_type"] == "llama3"
    assert rope["factor"] == 8.0


def test_engine_matches_transformers_past_the_original_context(long_dir: Path) -> None:
    loaded = load_model(long_dir, device="cpu")
    rng = random.Random(11)
    prompt = [rng.randrange(loaded.vocab_size) for _ in range(PROMPT)]
    # 256-token steps: the prompt's later chunks attend over a cached prefix past ORIGINAL.
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=2, max_num_batched_tokens=256))
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = generate_all(engine, [EngineRequest("long", tuple(prompt), sampling)])["long"]

    reference = AutoModelForCausalLM.from_pretrained(str(long_dir), dtype=torch.float32).eval()
    assert got == _greedy(reference, prompt, 8)
    # The scaling matters at these positions: without it the same weights answer otherwise, so
    # the equality above cannot come from an engine that ignored it.
    reference.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    unscaled = AutoModelForCausalLM.from_config(reference.config, dtype=torch.float32).eval()
    unscaled.load_state_dict(reference.state_dict())
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        scaled_logits = reference(ids, logits_to_keep=1).logits
        unscaled_logits = unscaled(ids, logits_to_keep=1).logits
    assert not torch.allclose(scaled_logits, unscaled_logits, atol=1e-4)
