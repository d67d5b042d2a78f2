"""The random models the load benchmarks' sites serve: a Llama of a given shape with a real
tokenizer, saved with `save_pretrained` and loaded by the site through the normal path (no
pretrained weights can be fetched here). Answers are replayed with `ignore_eos`, so only their
lengths matter. On the GPU the shape is SmolLM2-135M's; on the CPU a tiny one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import LlamaConfig

from fedllm_contract.tokenizer import CHATML_TEMPLATE, load_tokenizer
from site_engine.make_model import build_random_model

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int

    def config(self, vocab: int, eos: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.context,
            tie_word_embeddings=True,
            eos_token_id=eos,
            bos_token_id=eos,
        )


# CPU: a tiny model, so that sites, the gateway and the load share two cores.
TINY = ModelShape("tiny", 64, 2, 4, 2, 128, 1024)
# GPU: SmolLM2-135M's shape.
SMOL_135M = ModelShape("smollm2-135m", 576, 30, 9, 3, 1536, 8192)


def default_tokenizer() -> Path | None:
    """SmolLM2's tokenizer, from the converted model the demo and tests cache in var/models."""
    found = sorted((REPO_ROOT / "var" / "models").glob("SmolLM2-135M-Instruct-*/tokenizer.json"))
    return found[0].parent if found else None


def write_model(out: Path, shape: ModelShape, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random model of `shape` with the tokenizer, saved like a real model directory
    (reused when it is there already)."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    tokenizer = load_tokenizer(tokenizer_dir)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else len(tokenizer) - 1
    model = build_random_model(shape.config(len(tokenizer), int(eos)), seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return out
