"""The model the GPU engine benchmark runs: its shapes, how it is built, and its facts.

This module owns the benchmark's model: the Llama-3.2-1B shape (and the tiny shape of --small),
building a seeded random LlamaForCausalLM of that shape with transformers and saving it with the
tokenizer as a user's model directory would be (so that it is loaded back through
site_engine.model_loading.load_model), and the description of the loaded model that goes into
the results file (parameters, weight bytes, KV spec).
"""

from __future__ import annotations

import gc
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.engine.metrics import kv_bytes_per_token
from bench.engine.roofline import weight_bytes
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.kv_cache import KVCacheSpec, dtype_size
from site_engine.model_loading import LoadedModel

# Llama-3.2-1B's shape (default rope: the rope variant does not change the cost of a step).
LLAMA_1B_SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
}
# Llama-3.2-1B with its real context: 131,072 positions through Llama-3.1's rope scaling.
LLAMA_3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA_1B_LONG_SHAPE: dict[str, Any] = {
    **LLAMA_1B_SHAPE,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA_3_ROPE_SCALING,
}
# Llama-3.1-8B's shape and context.
LLAMA_8B_SHAPE: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {**LLAMA_3_ROPE_SCALING, "factor": 8.0},
}
# The 8B shape at 8,192 positions, and where the benches that use it keep it: built once a machine
# (bench.engine.priority and bench.engine.finetune_colocated share it).
LLAMA_8B_8K_SHAPE: dict[str, Any] = {**LLAMA_8B_SHAPE, "max_position_embeddings": 8192}
LLAMA_8B_8K_DIR = Path("/tmp/fedllm-bench-llama8b-8k")
SMALL_SHAPE: dict[str, Any] = {
    **LLAMA_1B_SHAPE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 50304,
}


def build_model_dir(
    out: Path,
    shape: dict[str, Any],
    tokenizer_dir: Path,
    dtype: torch.dtype,
    seed: int,
    device: str,
) -> tuple[Path, str]:
    """Random LlamaForCausalLM of `shape` saved with the tokenizer; returns (dir, where built)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(tokenizer_dir)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else len(tokenizer) - 1
    config = LlamaConfig(**shape, bos_token_id=int(eos), eos_token_id=int(eos))
    torch.manual_seed(seed)
    model = None
    built_on = "cpu"
    if torch.device(device).type == "cuda":
        try:  # initialising 1.2B parameters on the GPU takes seconds instead of a minute
            with torch.device(device):
                model = LlamaForCausalLM(config)
            built_on = device
        except Exception as exc:
            print(f"  building on {device} failed ({exc!r}); building on the CPU", flush=True)
            model = None
            gc.collect()
            torch.cuda.empty_cache()
    if model is None:
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out, built_on


def model_facts(loaded: LoadedModel, shape: dict[str, Any], built_on: str) -> dict[str, Any]:
    spec = KVCacheSpec.from_config(loaded.model.config)
    params = sum(p.numel() for p in loaded.model.parameters())
    return {
        "architecture": "LlamaForCausalLM, random weights (transformers init), seeded",
        "shape": shape,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "built_on": built_on,
        "parameters": params,
        "weight_bytes": weight_bytes(loaded),
        "tied_embeddings": bool(getattr(loaded.model.config, "tie_word_embeddings", False)),
        "kv_spec": asdict(spec),
        "kv_bytes_per_token": kv_bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype_size(loaded.dtype)
        ),
        "max_model_len": loaded.max_model_len,
        "tokenizer_tokens": len(loaded.tokenizer),
        "attn_implementation": getattr(loaded.model.config, "_attn_implementation", None),
    }


def ensure_model(
    model_dir: Path,
    shape: dict[str, Any],
    tokenizer_dir: Path | None,
    log: Any,
    *,
    dtype: str = "bfloat16",
    device: str = "cuda",
    seed: int = 0,
) -> LoadedModel:
    """The benchmark model loaded from `model_dir`, built there first if it holds none (so that
    several commands of one session, or a baseline run in a subprocess, share one build)."""
    from bench.engine.paths import shared_path
    from site_engine.model_loading import load_model

    if not (model_dir / "config.json").is_file():
        tokenizer = shared_path(tokenizer_dir, "tokenizers", "gpt2")
        torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            dtype, torch.float32
        )
        _, built_on = build_model_dir(model_dir, shape, tokenizer, torch_dtype, seed, device)
        log(f"model built on {built_on} and saved in {model_dir}")
    loaded = load_model(model_dir, device=device, dtype=dtype)
    log(f"model loaded from {model_dir}")
    return loaded


def preset_model(
    p: dict[str, Any],
    model_dir: Path | None,
    tokenizer_dir: Path | None,
    log: Any,
    name: str,
    seed: int = 0,
) -> LoadedModel:
    """A bench preset's model: `model_dir` if given, else the one 8B directory every bench of
    the Llama-3-8B shape shares (built once a machine), else /tmp/fedllm-bench-<name>. On the
    CPU, one torch thread: the benches time the engine, not intra-op parallelism."""
    default_dir = LLAMA_8B_8K_DIR if p["shape"] is LLAMA_8B_8K_SHAPE else None
    loaded = ensure_model(
        model_dir or default_dir or Path(f"/tmp/fedllm-bench-{name}"),
        p["shape"],
        tokenizer_dir,
        log,
        dtype=p["dtype"],
        device=p["device"],
        seed=seed,
    )
    if loaded.device.type == "cpu":
        torch.set_num_threads(1)
    return loaded
