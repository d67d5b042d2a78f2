"""Builds a small randomly initialised causal LM and saves it like a real model directory.

No pretrained causal-LM weights can be downloaded here, so the demo and the tests serve random
models; they go through `save_pretrained` and are loaded back through the normal loading path,
exactly as a user's real model directory would be.

    python -m site_engine.make_model --arch llama --out var/models/tiny-llama \
        --tokenizer ../shared/tokenizers/gpt2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from fedllm_contract.tokenizer import CHATML_TEMPLATE, load_tokenizer

Arch = Literal["llama", "qwen2", "gpt2"]
ARCHS: tuple[Arch, ...] = ("llama", "qwen2", "gpt2")


def tiny_config(
    arch: Arch, vocab_size: int, eos_token_id: int, hidden: int = 64, layers: int = 2
) -> PretrainedConfig:
    """A config small enough for CPU tests, with the structure of the real family."""
    common = {"vocab_size": vocab_size, "eos_token_id": eos_token_id, "bos_token_id": eos_token_id}
    if arch == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=1024, **common)
    shape = {
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    }
    if arch == "qwen2":
        return Qwen2Config(**shape, **common)
    return LlamaConfig(**shape, **common)


def build_random_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    model: PreTrainedModel
    if isinstance(config, GPT2Config):
        model = GPT2LMHeadModel(config)
    elif isinstance(config, Qwen2Config):
        model = Qwen2ForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    return model.eval()


def make_model_dir(
    out: Path, arch: Arch, tokenizer_dir: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0
) -> Path:
    """Writes config.json, model.safetensors and the tokenizer into `out` and returns it."""
    tokenizer = load_tokenizer(tokenizer_dir)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else len(tokenizer) - 1
    config = tiny_config(arch, len(tokenizer), int(eos), hidden=hidden, layers=layers)
    model = build_random_model(config, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    # Saved like a chat model, so the gateway's chat API has a template to render with.
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return out


# Llama-3.1's rope scaling, as its config.json spells it (`rope_scaling` next to `rope_theta`):
# positions past `original_max_position_embeddings` get their low frequencies stretched by
# `factor`, which is how 8k-position training serves 128k positions.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def make_long_context_dir(
    out: Path,
    tokenizer_dir: Path,
    *,
    max_positions: int = 131072,
    original_positions: int = 8192,
    seed: int = 0,
) -> Path:
    """A tiny Llama whose config.json reads like Llama-3.1's: `max_positions` positions through
    rope scaling of type "llama3" over `original_positions` trained ones, `rope_theta` 500,000,
    written in the hub's spelling so that loading converts it as it would a real checkpoint."""
    make_model_dir(out, "llama", tokenizer_dir, seed=seed)
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.pop("rope_parameters", None)
    config["max_position_embeddings"] = max_positions
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {
        **LLAMA3_ROPE_SCALING,
        "original_max_position_embeddings": original_positions,
    }
    path.write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--long-context",
        type=int,
        default=0,
        help="a Llama of this many positions through Llama-3.1 rope scaling (--arch llama)",
    )
    args = parser.parse_args()
    if args.long_context:
        path = make_long_context_dir(
            args.out, args.tokenizer, max_positions=args.long_context, seed=args.seed
        )
    else:
        path = make_model_dir(
            args.out, args.arch, args.tokenizer, hidden=args.hidden, layers=args.layers,
            seed=args.seed,
        )  # fmt: skip
    print(path)


if __name__ == "__main__":
    main()
