"""SmolLM2-135M-Instruct for the engine tests that run it on real weights: the model loaded
once per module (float32, two CPU threads) and chat prompts as its template writes them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from site_engine.model_loading import LoadedModel, load_model


@pytest.fixture(scope="module")
def loaded(smollm2_dir: Path) -> Iterator[LoadedModel]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield load_model(smollm2_dir)
    torch.set_num_threads(previous)


def chat_ids(loaded: LoadedModel, prompt: str) -> tuple[int, ...]:
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tuple(loaded.tokenizer.encode(str(text), add_special_tokens=False))
